//! What differs per database: one folder per backend (`pg/`, `mysql/`, `sqlite/`) holds all
//! of that backend's SQL, a file per concern, behind one internal trait (`Dialect`, with its
//! supertraits `Locks` and `Admin`, and `SessionLocks` where the backend has session locks).
//! Strategy code calls the trait and never asks which database it talks to. SQL that is the
//! same on several backends is written once, in `shared.rs`.

use crate::Result;
use chrono::{DateTime, Utc};
use diesel::QueryResult;

#[macro_use]
mod line;
mod any;
#[cfg(feature = "bench-sql")]
pub mod bench_sql;
pub(crate) mod fence;
pub(crate) mod for_share;
pub(crate) mod holders;
pub(crate) mod interrupt;
#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
pub(crate) mod pg;
mod shared;
#[cfg(feature = "sqlite")]
pub(crate) mod sqlite;
pub(crate) mod stmt;
mod url;

pub use any::{connect, AnyConnection};
pub(crate) use any::{locker_pool, open, Failures};
#[cfg(feature = "sqlite")]
pub use sqlite::SqliteTuning;
pub use url::mask_secrets;
pub(crate) use url::{behind_pooler, Target, DEFAULT_POOL_SIZE};

/// The database a connection talks to.
///
/// ```
/// # fn main() -> diesel_lock::Result<()> {
/// # let dir = tempfile::tempdir().unwrap();
/// # let url = dir.path().join("l.db");
/// let locker = diesel_lock::Locker::connect(url.to_str().unwrap())?.build()?;
/// assert_eq!(locker.backend(), diesel_lock::Backend::Sqlite);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Backend {
    /// PostgreSQL.
    Postgres,
    /// MySQL or MariaDB.
    Mysql,
    /// SQLite.
    Sqlite,
}

impl Backend {
    /// The backend's name, as used in messages.
    ///
    /// ```
    /// assert_eq!(diesel_lock::Backend::Postgres.name(), "postgresql");
    /// ```
    pub fn name(self) -> &'static str {
        match self {
            Backend::Postgres => "postgresql",
            Backend::Mysql => "mysql",
            Backend::Sqlite => "sqlite",
        }
    }
}

/// A connection type the library can keep locks in.
///
/// Implemented (sealed) for diesel's `PgConnection`, `MysqlConnection`, `SqliteConnection`
/// (each behind its feature) and for [`AnyConnection`], which picks the backend at run time.
/// It is only a bound: the statements behind it belong to the crate, and no other crate can
/// implement it or run them (so changing them is never a breaking change).
///
/// ```
/// fn takes_any_lock_connection<C: diesel_lock::LockConnection>() {}
/// takes_any_lock_connection::<diesel::SqliteConnection>();
/// takes_any_lock_connection::<diesel_lock::AnyConnection>();
/// ```
///
/// The library's statements cannot be called from outside it, not even through the bound
/// (they are not methods of `LockConnection` or of any trait it extends):
///
/// ```compile_fail
/// fn delete_someones_row<C: diesel_lock::LockConnection>(c: &mut C) {
///     let _ = c.row_release(7, "h"); // error: no method named `row_release`
/// }
/// ```
///
/// nor, from safe code, can the way to them be opened: it takes a key that only this crate
/// can make.
///
/// ```compile_fail
/// fn open<C: diesel_lock::LockConnection>(c: &mut C) {
///     let _ = c.dialect(Default::default()); // error: the key cannot be made here
/// }
/// ```
///
/// nor can another crate implement it:
///
/// ```compile_fail
/// struct Mine;
/// impl diesel_lock::LockConnection for Mine {}
/// ```
pub trait LockConnection: sealed::Sealed + diesel::r2d2::R2D2Connection + Send + 'static {}

impl<T> LockConnection for T where T: sealed::Sealed + diesel::r2d2::R2D2Connection + Send + 'static {}

#[cfg_attr(
    not(any(feature = "postgres", feature = "mysql")),
    allow(unused_imports)
)]
pub(crate) use line::{Line, Told};
pub(crate) use sealed::{
    Acquired, Dialect, Drawn, Flavor, ForUpdateLocked, Joined, PurgeTable, SessionLocks, Spot,
    Wait, XactLocked,
};

/// The `place` of an acquisition by a caller that has no place in the key's line (a
/// newcomer): it must wait behind every live place.
pub(crate) const NO_PLACE: i64 = i64::MAX;

/// Keys per purge batch: each batch is one short transaction, so that an acquisition meeting
/// a purge waits for at most one batch.
pub(crate) const PURGE_BATCH: i64 = 1000;

/// How the crate reaches the statements of a connection: `conn.sql()`.
pub(crate) trait Sql {
    /// This connection's statements.
    fn sql(&mut self) -> &mut dyn Dialect;
    /// The statements of the session strategies; an error on a backend without them (never
    /// reached: `build` refuses those strategies there).
    fn session_sql(&mut self) -> QueryResult<&mut dyn SessionLocks> {
        self.sql().sessions().ok_or_else(|| {
            diesel::result::Error::QueryBuilderError(
                "this backend has no row or session locks".into(),
            )
        })
    }
}

impl<C: LockConnection> Sql for C {
    fn sql(&mut self) -> &mut dyn Dialect {
        self.dialect(sealed::Seal(()))
    }
}

/// The backend of every connection of type `C`, when the type fixes it.
pub(crate) fn static_backend<C: LockConnection>() -> Option<Backend> {
    C::static_backend(sealed::Seal(()))
}

pub(crate) mod sealed;

use crate::lock_info::LockInfo;
pub(crate) use sealed::Held;

/// The body of `admin_force_release`, run by each backend inside a transaction. Removal goes
/// by row id and holder id, and only what was removed is returned, so a lock released after
/// the read is not reported and one taken anew after it is left alone.
pub(crate) fn force_release_in<C: sealed::Dialect>(
    conn: &mut C,
    key: &str,
) -> QueryResult<Vec<LockInfo>> {
    let mut removed = Vec::new();
    for held in conn.admin_rows(Some(key))? {
        if conn.row_release(held.id, held.holder.as_deref().unwrap_or(""))? {
            removed.push(held.info);
        }
    }
    for held in conn.admin_leases(Some(key))? {
        if let Some(holder) = &held.holder {
            if conn.lease_release(key, holder)? {
                removed.push(held.info);
            }
        }
    }
    Ok(removed)
}

/// Runs `f` under a guard that, should `f` fail with a migration error caused by another
/// process migrating at the same moment, runs it once more (by then nothing is pending).
pub(crate) fn migrate_with_retry<C>(
    conn: &mut C,
    mut f: impl FnMut(&mut C) -> Result<()>,
) -> Result<()> {
    match f(conn) {
        Ok(()) => Ok(()),
        Err(first) => {
            log::debug!(
                "migration failed ({first}); retrying once in case another process raced us"
            );
            f(conn)
        }
    }
}
