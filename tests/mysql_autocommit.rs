//! Issue 8, "also noticed": a MySQL pool the user builds (not through `connect()`) was not
//! checked for `autocommit = 1`. On sessions with autocommit off every lock stays
//! uncommitted on its pooled connection: before, `build()` said Ok and a lock taken through
//! such a pool was invisible to every other session. Now `build()` refuses it.
#![cfg(feature = "mysql")]

mod common;

use diesel::connection::SimpleConnection;
use diesel::r2d2::{ConnectionManager, CustomizeConnection, Pool};
use diesel::MysqlConnection;
use diesel_lock::{Error, Locker, Strategy};

#[derive(Debug)]
struct AutocommitOff;

impl CustomizeConnection<MysqlConnection, diesel::r2d2::Error> for AutocommitOff {
    fn on_acquire(&self, c: &mut MysqlConnection) -> Result<(), diesel::r2d2::Error> {
        c.batch_execute("SET SESSION autocommit = 0")
            .map_err(diesel::r2d2::Error::QueryError)
    }
}

#[test]
fn a_pool_with_autocommit_off_is_refused() {
    let Some(url) = common::url("DLOCK_TEST_MYSQL_URL", "mysql") else {
        return;
    };
    let pool = Pool::builder()
        .max_size(2)
        .min_idle(Some(0))
        .connection_customizer(Box::new(AutocommitOff))
        .build(ConnectionManager::<MysqlConnection>::new(url))
        .unwrap();
    for strategy in [
        Strategy::default(),
        Strategy::Row { stale_after: None },
        Strategy::ForUpdate,
        Strategy::Advisory,
    ] {
        let r = Locker::builder(pool.clone()).strategy(strategy).build();
        match r {
            Err(Error::InvalidConfig(why)) => assert!(why.contains("autocommit"), "{why}"),
            other => panic!("{strategy:?}: {other:?}"),
        }
    }
}
