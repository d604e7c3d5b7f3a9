//! Migrations killed half way (found by the adversary run of issue 8): on MySQL every DDL
//! statement commits at once, before diesel records the migration, so a `migrate()` killed
//! between the two left a database that no later `migrate()` could upgrade ("Duplicate
//! column name 'stale_at'"), and Row calls then said "run migrate". Each migration must be
//! able to run again over its own half-done work.
//!
//! The test databases are its own (`dlock_t_…`, which `scripts/services.sh` lets the test
//! role create), made and dropped here: the half-done states are set up by hand on them.
#![cfg(feature = "mysql")]

mod common;

use diesel::connection::SimpleConnection;
use diesel::{Connection, MysqlConnection};
use diesel_lock::{Locker, Strategy};

/// A database of this test's own, dropped at the end.
struct Scratch {
    admin: MysqlConnection,
    name: String,
    url: String,
}

impl Scratch {
    fn new(base_url: &str) -> Scratch {
        let name = format!("dlock_t_{}_{}", std::process::id(), rand_suffix());
        let mut admin = MysqlConnection::establish(base_url).unwrap();
        admin
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .unwrap();
        let (head, _) = base_url.rsplit_once('/').unwrap();
        Scratch {
            admin,
            url: format!("{head}/{name}"),
            name,
        }
    }
}

fn rand_suffix() -> usize {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos() as usize
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = self
            .admin
            .batch_execute(&format!("DROP DATABASE IF EXISTS {}", self.name));
    }
}

/// Undoes diesel's record of the migrations from `version` on, leaving their work in place,
/// as a `migrate()` killed after its DDL but before the record would; `extra` then adds
/// what a kill inside a migration leaves.
fn migrate_again_after<F: FnOnce(&mut MysqlConnection)>(base_url: &str, version: &str, extra: F) {
    let db = Scratch::new(base_url);
    let pool = common::pool::<MysqlConnection>(&db.url, 2);
    let locker = Locker::builder(pool.clone())
        .strategy(Strategy::Row { stale_after: None })
        .build()
        .unwrap();
    locker.migrate().unwrap();
    let mut c = MysqlConnection::establish(&db.url).unwrap();
    c.batch_execute(&format!(
        "DELETE FROM __diesel_schema_migrations WHERE version >= '{version}'"
    ))
    .unwrap();
    extra(&mut c);
    locker
        .migrate()
        .unwrap_or_else(|e| panic!("migrate again after {version}: {e:?}"));
    let g = locker.try_lock("after").unwrap().expect("free");
    g.release().unwrap();
    for s in [Strategy::Advisory, Strategy::ForUpdate] {
        let l = Locker::builder(pool.clone()).strategy(s).build().unwrap();
        let g = l.try_lock("after").unwrap().expect("free");
        assert!(g.token() > 0);
        g.release().unwrap();
    }
}

#[test]
fn each_mysql_migration_runs_again_over_its_own_work() {
    let Some(url) = common::url("DLOCK_TEST_MYSQL_URL", "mysql") else {
        return;
    };
    // Killed after migration 16 (both created_at columns), or inside it, after its first.
    migrate_again_after(&url, "00000000000016", |_| {});
    migrate_again_after(&url, "00000000000016", |c| {
        c.batch_execute("ALTER TABLE dlock_shared_keys DROP COLUMN created_at")
            .unwrap();
    });
    // Killed after migration 14's rename (before diesel recorded it).
    migrate_again_after(&url, "00000000000014", |_| {});
    // Killed after migration 6 (the fencing bound, the MEMORY table, MariaDB's sequence).
    migrate_again_after(&url, "00000000000006", |_| {});
    // Killed inside migration 6, after its first table: the rest runs on.
    migrate_again_after(&url, "00000000000006", |c| {
        c.batch_execute("DROP TABLE dlock_fence_live").unwrap();
    });
    // Killed after migration 5's ALTER TABLE (the adversary's "try 2").
    migrate_again_after(&url, "00000000000005", |_| {});
    // Killed after migration 4's (its "try 11"): 4 and 5 both run again.
    migrate_again_after(&url, "00000000000004", |_| {});
    // Killed inside migration 3, between its INSERT of the starting fence and its DELETE.
    migrate_again_after(&url, "00000000000003", |c| {
        c.batch_execute(
            "INSERT INTO dlock_fences (id, lock_key) \
             SELECT COALESCE(MAX(version), 0) + 1, '' FROM dlock_for_update",
        )
        .unwrap();
    });
}
