//! `dlock release --force`, which removes a stuck lock and says what it removed, and
//! `dlock migrate`, which creates or upgrades the lock tables.

use crate::args::{Failure, EXIT_USAGE};
use crate::database::Database;
use crate::list::{describe_holder, output};
use diesel_lock::{admin, Error, Locker};

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
