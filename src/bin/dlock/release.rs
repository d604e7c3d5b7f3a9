//! `dlock release --force`, which removes a stuck lock and says what it removed,
//! `dlock migrate`, which creates or upgrades the lock tables, and `dlock purge`, which
//! deletes the rows of keys nobody holds.

use crate::args::{Failure, EXIT_USAGE};
use crate::database::Database;
use crate::list::{describe_holder, output};
use diesel_lock::{admin, Error, Locker, Strategy};
use std::time::Duration;

pub(crate) fn release(db: &Database, key: &str, force: bool) -> Result<u8, Failure> {
    if !force {
        return Err(Failure::new(
            EXIT_USAGE,
            format!("refusing to remove the lock on {key:?} without --force: its holder may be alive (see `dlock status {key}`)"),
        ));
    }
    let pool = db.connect()?;
    let mut conn = pool.get().map_err(Error::from)?;
    let removed = match admin::force_release(&mut *conn, key) {
        Err(Error::MissingTable(_)) => Vec::new(),
        other => other?,
    };
    if removed.is_empty() {
        output(&format!("{key:?} was not held; nothing removed\n"))?;
    }
    for i in &removed {
        output(&format!(
            "removed the {} lock on {key:?} held by {}\n",
            i.strategy,
            describe_holder(i)
        ))?;
    }
    Ok(0)
}

pub(crate) fn migrate(db: &Database) -> Result<u8, Failure> {
    let pool = db.connect()?;
    let locker = Locker::builder(pool).build()?;
    locker.migrate()?;
    output(&format!(
        "the lock tables are up to date ({})\n",
        locker.backend().name()
    ))?;
    Ok(0)
}

/// `dlock purge`: the purges of `Lease` (leases free or expired for `older_than`, expired
/// readers and permits, kinds and counters of keys nobody holds), of `Row` (rows past
/// their own `stale_after`, counters of keys nobody holds), which is what `dlock run`
/// leaves behind, and of `ForUpdate` where the server has it (key rows nobody holds); no
/// lock tables yet means nothing to delete.
pub(crate) fn purge(db: &Database, older_than: Duration) -> Result<u8, Failure> {
    let pool = db.connect()?;
    let mut deleted = 0;
    for strategy in [
        Strategy::Lease {
            ttl: Duration::from_secs(30),
        },
        Strategy::Row { stale_after: None },
        Strategy::ForUpdate,
    ] {
        let locker = match Locker::builder(pool.clone()).strategy(strategy).build() {
            // SQLite, a Galera node: no ForUpdate, so none of its rows either.
            Err(Error::Unsupported { .. } | Error::Incompatible { .. })
                if strategy == Strategy::ForUpdate =>
            {
                continue
            }
            other => other?,
        };
        deleted += match locker.purge(older_than) {
            Err(Error::MissingTable(_)) => 0,
            other => other?,
        };
    }
    output(&format!(
        "deleted {deleted} row{} of keys nobody holds\n",
        if deleted == 1 { "" } else { "s" }
    ))?;
    Ok(0)
}
