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

pub(crate) mod sealed {
    use super::*;

    /// The key to a connection's statements. Its field is private to this crate, so only the
    /// crate can make one, and only the crate can call [`Sealed`]'s methods.
    #[derive(Debug)]
    pub struct Seal(pub(crate) ());

    /// The supertrait that seals [`LockConnection`](super::LockConnection): public only in
    /// this unnameable module, so no other crate can implement it, and its methods take a
    /// [`Seal`], which no other crate can make.
    pub trait Sealed {
        /// This connection's statements.
        #[doc(hidden)]
        fn dialect(&mut self, seal: Seal) -> &mut dyn Dialect;
        /// The backend of every connection of this type, when it is fixed by the type.
        #[doc(hidden)]
        fn static_backend(seal: Seal) -> Option<Backend>;
    }

    /// What a successful acquisition returns from the database.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct Acquired {
        /// Row strategy: the row's id (release deletes by it). Lease: unused (0).
        pub id: i64,
        pub token: i64,
        pub acquired_at: DateTime<Utc>,
    }

    /// The tables a purge deletes released keys' rows from, in batches of `PURGE_BATCH` keys.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum PurgeTable {
        /// `dlock_tokens`: the counters of `Row` keys (and of leases, saved by older versions).
        Counters,
        /// `dlock_leases`, and with each lease row the key's kind (`dlock_shared_keys`, its
        /// readers' and permits' number) if it has one.
        Leases,
        /// `dlock_for_update`: `ForUpdate`'s key rows that no holder (writer or reader) has
        /// locked. They carry no token (`ForUpdate` draws from the global source), so
        /// nothing is kept of them; a key's next acquisition makes its row again.
        KeyRows,
        /// `dlock_shared_keys` rows of the reader-writer kind (no permits) with no live
        /// writer's mark and no lease row, permit slot or `ForUpdate` key row of their key
        /// (`ForUpdate`'s readers and marks; a `Lease` key's kind goes with its lease row).
        /// Semaphores' rows stay: their slots (or advisory slot locks) follow their number.
        Kinds,
    }

    /// What a server offers the session strategies beyond their common SQL, asked once
    /// when a `Locker` is built.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Flavor {
        /// PostgreSQL, MariaDB.
        Standard,
        /// MySQL proper, which has no `@@in_transaction`: a `ForUpdate` transaction proves
        /// that it is still open by a row of its own in `dlock_fences`.
        Mysql,
    }

    /// What an acquiring statement drew: the token (`None` when this life has no offset yet,
    /// or this session has not read it) and the bound it saw.
    #[derive(Debug, Clone, Copy)]
    pub struct Drawn {
        pub token: Option<i64>,
        pub high: Option<i64>,
    }

    /// What `SessionLocks::for_update_lock` found.
    #[derive(Debug, Clone, Copy)]
    pub enum ForUpdateLocked {
        /// The key has no row yet: the caller rolls back and creates it.
        Missing,
        /// The row is locked and the token may be handed out.
        Locked(Acquired),
        /// The row is locked but the token may not be handed out yet: the caller rolls back,
        /// calls `fence_prepare` with this and tries again.
        Unfenced(Option<i64>),
        /// A reader found a writer's mark (`for_share.rs`): the caller rolls back; busy.
        Blocked,
    }

    /// What `SessionLocks::advisory_xact_lock` found.
    #[derive(Debug, Clone, Copy)]
    pub enum XactLocked {
        /// Held by someone else (`try_lock`'s attempt).
        Busy,
        /// The lock is the transaction's and the token may be handed out.
        Locked(Acquired),
        /// The lock is the transaction's but the token may not be handed out yet: the caller
        /// rolls back, calls `fence_prepare` with this and tries again.
        Unfenced(Option<i64>),
    }

    /// How long an acquisition may wait on the server while someone else holds the lock.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Wait {
        /// Not at all: `NOWAIT`, `pg_try_advisory_lock`, `GET_LOCK(name, 0)`.
        No,
        /// At most this long. A server that only counts whole seconds may be asked to wait
        /// less (never more); the locker's loop then tries again until its deadline.
        For(std::time::Duration),
        /// As long as the server lets it. A server-side limit (a role's `lock_timeout`,
        /// `innodb_lock_wait_timeout`) ends the wait as "busy", and the locker tries again.
        Forever,
    }

    /// The SQL of every strategy, per backend, by concern: [`Locks`] (`Row` and `Lease`),
    /// [`Admin`] (admin reads, force release, purge, optimistic versions) and, on the
    /// backends that have them, [`SessionLocks`] (through [`Dialect::sessions`]). This trait
    /// itself classifies the connection and its errors and runs the migrations. Durations
    /// are whole microseconds.
    pub trait Dialect: Locks + Lines + Admin + crate::backend::holders::HolderLocks {
        /// The backend of this connection.
        fn backend(&self) -> Backend;
        /// Creates or upgrades the tables; safe to run from many processes at once.
        fn run_migrations(&mut self) -> Result<()>;
        /// True if the newest migration this build embeds has been applied. Migrations are
        /// recorded one by one as each completes, so on MySQL, whose DDL commits statement by
        /// statement, this is also how another process tells a schema still being migrated
        /// from a finished one. A database never migrated (no record table) is not current.
        fn schema_current(&mut self) -> QueryResult<bool>;
        /// Why this session's settings cannot keep locks safely, if they cannot: MySQL with
        /// `autocommit = 0` (every lock written through it would stay uncommitted, and
        /// invisible to everyone else, on a pooled connection); SQLite without WAL and a busy
        /// timeout (`SqliteTuning`); PostgreSQL sessions at SERIALIZABLE (there a `ForUpdate`
        /// holder's `check()` was aborted by the server). Asked once per `build`; `lines`:
        /// the strategy keeps a line of waiters (`Row`, `Lease`), which PostgreSQL at
        /// REPEATABLE READ does not keep in order (a warning, not a refusal).
        fn misconfigured(&mut self, lines: bool) -> QueryResult<Option<String>> {
            let _ = lines;
            Ok(None)
        }
        /// Why this server's session locks (`GET_LOCK`, `FOR UPDATE` row locks) would
        /// exclude nothing between its clients, if so: a node of a Galera cluster (MySQL's
        /// `@@wsrep_on`), where they lock one node only. Asked once, when a `ForUpdate` or
        /// `Advisory` `Locker` is built.
        fn session_locks_local(&mut self) -> QueryResult<Option<&'static str>> {
            Ok(None)
        }
        /// True if `e` means "someone else is competing for this lock right now" (deadlock,
        /// lock-wait timeout, busy database) rather than a real failure.
        fn is_contention(&self, e: &diesel::result::Error) -> bool;
        /// True if the server rolled back the statement that failed with `e` to end a
        /// deadlock or a serialization conflict (on a Galera node, a certification
        /// conflict): it did nothing, no lock wait ran out, and it may run again at once.
        /// Every such error is also contention (`is_contention`). None on SQLite, whose
        /// busy errors come after its busy handler waited.
        fn is_rolled_back(&self, e: &diesel::result::Error) -> bool {
            let _ = e;
            false
        }
        /// The row locks and session locks of the session strategies (`ForUpdate`,
        /// `Advisory`), or `None` on a backend that has neither (SQLite).
        fn sessions(&mut self) -> Option<&mut dyn SessionLocks> {
            None
        }
        /// The shared session locks (PostgreSQL's `pg_advisory_lock_shared`), or `None`.
        fn shared_sessions(
            &mut self,
        ) -> Option<&mut dyn crate::backend::holders::SharedSessionLocks> {
            None
        }
        /// The readers of `ForUpdate` (`FOR SHARE`), or `None` (SQLite).
        fn for_share(&mut self) -> Option<&mut dyn crate::backend::for_share::ForShareLocks> {
            None
        }
    }

    /// The statements of the `Row` and `Lease` strategies.
    ///
    /// `retry` is true when the caller already failed an attempt on this key: backends where
    /// a failed write attempt is costly (MySQL's insert locks, SQLite's single writer) then
    /// look first with a plain read and skip the write while the key is visibly held.
    pub trait Locks {
        /// Inserts the key's row stamped with `holder` (unique per acquisition), if absent.
        /// `stale_us`: the row goes stale that long after it is inserted (stored with it as
        /// `stale_at`, database clock); `None`: never.
        fn row_acquire(
            &mut self,
            key: &str,
            owner: &str,
            holder: &str,
            stale_us: Option<i64>,
            retry: bool,
            place: i64,
        ) -> QueryResult<Option<Acquired>>;
        /// Deletes the key's row if `holder` inserted it: the clean-up after an acquisition
        /// that failed once its INSERT may have committed. True if a row was deleted.
        fn row_forget(&mut self, key: &str, holder: &str) -> QueryResult<bool>;
        /// Deletes the key's row if it is past its own `stale_at`; true if one was deleted.
        fn row_delete_stale(&mut self, key: &str) -> QueryResult<bool>;
        /// Deletes the row `id` if `holder` still holds it (its holder id; `""` matches a
        /// row from before holder ids, which has none); false if it was no longer there. An
        /// id alone is not enough: after a failover to a standby that lagged, the same id can
        /// be handed out again to another holder.
        fn row_release(&mut self, id: i64, holder: &str) -> QueryResult<bool>;
        /// `row_release` of a row a release granted (confirmed by `row_confirm`): others were
        /// in line a moment ago and most likely still are, so the hand-over runs at once,
        /// without the plain release that goes first when nobody is in line (which would
        /// find a place and touch nothing: a statement for nothing on every hand-over).
        fn row_release_granted(&mut self, id: i64, holder: &str) -> QueryResult<bool> {
            self.row_release(id, holder)
        }
        /// Whether the row `id` is still there and still `holder`'s, as `row_release` matches.
        fn row_held(&mut self, id: i64, holder: &str) -> QueryResult<bool>;
        /// Confirms a grant (`row_release` gave the key to place `place`, whose holder id is
        /// `holder`): while the granted row is still `holder`'s and its confirmation
        /// deadline has not passed, its `stale_at` becomes the holder's own (`stale_us`
        /// from now; `None`: never) and the place goes. `None` if the grant lapsed or was
        /// taken away (a forced release).
        fn row_confirm(
            &mut self,
            key: &str,
            place: i64,
            holder: &str,
            stale_us: Option<i64>,
        ) -> QueryResult<Option<Acquired>>;
        /// Releases `key`'s row if `holder` holds it, as `row_release` does (handing it on):
        /// what a waiter that gives up does when its place may have been granted. Read by
        /// key and holder id, then released by id and holder id.
        fn row_give_back(&mut self, key: &str, holder: &str) -> QueryResult<bool>;

        fn lease_acquire(
            &mut self,
            key: &str,
            owner: &str,
            holder: &str,
            ttl_us: i64,
            retry: bool,
            place: i64,
        ) -> QueryResult<Option<Acquired>>;
        /// Extends an unexpired lease still held by `holder`; false if it is not. Waits for a
        /// row lock taken by another session at most about `bound` (PostgreSQL:
        /// `lock_timeout`; MySQL: `innodb_lock_wait_timeout`, whole seconds, at least 1;
        /// SQLite: the connection's `busy_timeout`), then fails as busy.
        fn lease_renew(
            &mut self,
            key: &str,
            holder: &str,
            ttl_us: i64,
            bound: std::time::Duration,
        ) -> QueryResult<bool>;
        /// Renews many leases (`leases`: keys and their holder ids, at most 500) in one
        /// statement, each as `lease_renew` would, except that a lease whose row another
        /// session has locked is skipped, never waited for (PostgreSQL, MySQL: `FOR UPDATE
        /// SKIP LOCKED`; SQLite has one writer, waited for as long as its `busy_timeout`).
        /// Returns the holder ids renewed; the caller renews the others one by one, which
        /// tells a lost lease from a stuck one.
        fn lease_renew_many(
            &mut self,
            leases: &[(String, String)],
            ttl_us: i64,
        ) -> QueryResult<Vec<String>>;
        /// Clears the lease if `holder` still holds it; false if it did not. If a live place
        /// of the key's line is waiting, the key goes to the first one instead, in the same
        /// statement or transaction (a grant: see `Lines`).
        fn lease_release(&mut self, key: &str, holder: &str) -> QueryResult<bool>;
        /// `lease_release` of a lease a release granted to place `place` (taken with the
        /// look that saw the grant, `Lines::line_look_lease`), whose confirmation, which removes the place, may not have run
        /// yet: the place goes too (PostgreSQL, by its id in the same statement; SQLite's
        /// trigger and MySQL's release remove it by the holder id whatever the caller says).
        /// The hand-over at once, as `row_release_granted`.
        fn lease_release_granted(
            &mut self,
            key: &str,
            holder: &str,
            _place: i64,
        ) -> QueryResult<bool> {
            self.lease_release(key, holder)
        }
        /// Confirms a grant, as `row_confirm`: the lease, still `holder`'s and unexpired,
        /// runs `ttl_us` from now, and place `place` goes.
        fn lease_confirm(
            &mut self,
            key: &str,
            place: i64,
            holder: &str,
            ttl_us: i64,
        ) -> QueryResult<Option<Acquired>>;
        fn lease_held(&mut self, key: &str, holder: &str) -> QueryResult<bool>;
    }

    /// The statements of `optimistic::transaction`, of the admin functions and of
    /// `Locker::purge`.
    /// The line of waiters of `Row` and `Lease` keys (`dlock_waiters`, `locker/line.rs`).
    ///
    /// A place is a row with a number that only grows, the waiter's owner, its `Locker`'s
    /// notification channel (PostgreSQL) and an expiry on the database clock. The acquiring
    /// statements of `Locks` take a `place`: the number of the caller's own place, or
    /// [`NO_PLACE`](super::NO_PLACE) for a newcomer; they take a free key only if no live
    /// place with a lower number exists, and a waiter's acquisition removes its place.
    pub trait Lines {
        /// Takes a place at the end of `key`'s `line` (whose lock: see [`Line`]), alive for
        /// `ttl_us`; returns its number.
        /// `holder`: the holder id the waiter will hold the key under if a release grants it
        /// the key.
        /// `shared`: the place of a reader or a semaphore permit, which others of its kind
        /// may be let in past (`line_ahead`); otherwise an exclusive waiter's.
        /// `flag`: the key's `Lease` row is marked as waited for (`line_free` cleared: its
        /// acquisitions and releases then look into the line), in the join's own
        /// transaction, before the place is visible (PostgreSQL: made free and marked if the
        /// key has none; SQLite and MySQL: see their `line_join`); without it no row is
        /// touched (the key's other strategies' places do not concern `Lease`).
        #[allow(clippy::too_many_arguments)]
        fn line_join(
            &mut self,
            key: &str,
            line: Line,
            owner: &str,
            channel: Option<&str>,
            ttl_us: i64,
            holder: &str,
            shared: bool,
            flag: bool,
        ) -> QueryResult<Joined>;
        /// The live places of `key`'s `line` ahead of place `place` (every live place for
        /// [`NO_PLACE`](super::NO_PLACE)): how many, and how many of them are exclusive
        /// waiters'. A read only; inside the caller's transaction if one is open.
        fn line_ahead(&mut self, key: &str, line: Line, place: i64) -> QueryResult<LineAhead>;
        /// Keeps place `id` alive for `ttl_us` more and counts the live places ahead of it;
        /// `None` if the place is gone or lapsed (others have been let past it meanwhile:
        /// its waiter joins again, at the end, rather than jump back ahead of them).
        /// A granted place is not renewed: its grant's deadline is its expiry.
        /// `floor`: no place below it can be live any more (`Spot::floor` of an earlier
        /// answer; 0 for none): the count starts there.
        fn line_renew(
            &mut self,
            key: &str,
            line: Line,
            id: i64,
            ttl_us: i64,
            floor: i64,
        ) -> QueryResult<Option<Spot>>;
        /// Counts the live places ahead of place `id`, with a read only (no write: on SQLite
        /// a write would queue for the database's one write lock); `None` if the place is
        /// gone.
        /// `floor` as for `line_renew`.
        fn line_look(
            &mut self,
            key: &str,
            line: Line,
            id: i64,
            floor: i64,
        ) -> QueryResult<Option<Spot>>;
        /// `line_look` for a `Lease` waiter, in the same statement: if the place is granted,
        /// the lease (token, acquisition time) the grant gave `holder` (`Spot::lease`; `None`
        /// if it lapsed or was taken away): the waiter needs no read more to take it.
        fn line_look_lease(
            &mut self,
            key: &str,
            id: i64,
            floor: i64,
            holder: &str,
        ) -> QueryResult<Option<Spot>>;
        /// Gives place `id` up. On PostgreSQL the first live place left is notified, in case
        /// the key is free and it was waiting behind this one. True if the place had been
        /// granted the key: the caller then gives the key back (`row_give_back`, `lease_release`), which hands it
        /// on. The removal comes first and commits: a release that has not granted the place
        /// yet can no longer do so, and one that has is seen by the give-back.
        fn line_leave(&mut self, key: &str, line: Line, id: i64) -> QueryResult<bool>;
        /// The live lines: per key (all keys, or one) and line, how many wait and how long the
        /// longest has waited, in microseconds of database time. A place granted the key
        /// (not yet confirmed) holds it, and is not counted.
        fn line_stats(&mut self, key: Option<&str>) -> QueryResult<Vec<LineStat>>;
        /// Removes lapsed places; how many.
        fn purge_lapsed_places(&mut self) -> QueryResult<usize>;
    }

    /// Where a live place stands (`Lines::line_renew`, `line_look`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct Spot {
        /// Live places ahead of it.
        pub ahead: i64,
        /// The exclusive waiters' among them (what a reader or a permit must not pass).
        pub exclusive: i64,
        /// A release granted it the key: its waiter confirms.
        pub granted: bool,
        /// The lowest live place waiting at or below it (PostgreSQL; `None` elsewhere): a
        /// place below it never lives again (a place's expiry moves only while it is live,
        /// its number is never reused), so later counts may start there. On PostgreSQL a
        /// count over the key's index entries from the bottom read every place the key had
        /// since the last vacuum (a hand-over leaves two dead: 1,199 read by one look after a
        /// 4 s run, 0.35 ms).
        pub floor: Option<i64>,
        /// Granted on `Lease`: the lease the grant gave the place's holder, read by the same
        /// look (`Lines::line_look_lease`), so that the waiter need not read it again.
        pub lease: Option<Acquired>,
    }

    /// A place taken (`Lines::line_join`).
    #[derive(Debug, Clone, Copy)]
    pub struct Joined {
        /// The place's number.
        pub id: i64,
    }

    /// The places ahead of one, as `Lines::line_ahead` counts them.
    #[derive(Debug, Clone, Copy, diesel::QueryableByName)]
    pub struct LineAhead {
        /// Every live place ahead.
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        pub ahead: i64,
        /// The exclusive waiters' among them.
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        pub exclusive: i64,
    }

    /// One key's line, as `Lines::line_stats` reads it.
    #[derive(Debug, Clone, diesel::QueryableByName)]
    pub struct LineStat {
        #[diesel(sql_type = diesel::sql_types::Text)]
        pub lock_key: String,
        /// Whose line (`Line::id`).
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        pub line: i64,
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        pub waiting: i64,
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        pub longest_us: i64,
    }

    pub trait Admin {
        // optimistic::transaction.

        /// The key's version, `None` if it has no row yet.
        fn version_read(&mut self, key: &str) -> QueryResult<Option<i64>>;
        /// Creates the key's version row (version 0) if absent.
        fn version_create(&mut self, key: &str) -> QueryResult<()>;
        /// `version = version + 1` if it is still `seen`; true if it was.
        fn version_bump(&mut self, key: &str, seen: i64) -> QueryResult<bool>;

        // The admin functions.

        /// The `Row` locks held now, of every key or of one, ordered by key. A plain read: it
        /// never locks a row, so it cannot hold up a holder's renewal or release.
        fn admin_rows(&mut self, key: Option<&str>) -> QueryResult<Vec<Held>>;
        /// The unexpired leases, of every key or of one, ordered by key; a plain read too.
        /// Rows a purge has marked (`holder = ''`) are held by nobody and not listed.
        fn admin_leases(&mut self, key: Option<&str>) -> QueryResult<Vec<Held>>;
        /// Removes the key's row and clears its lease if held, reading and removing in one
        /// transaction (see [`force_release_in`]); returns what was removed.
        fn admin_force_release(&mut self, key: &str) -> QueryResult<Vec<LockInfo>>;

        // Locker::purge.

        /// Deletes every `Row` lock past its own `stale_at` (never one without); the number
        /// deleted. Their tokens live on in `dlock_tokens`.
        fn purge_stale_rows(&mut self) -> QueryResult<usize>;
        /// Before a purge's steps, on the connection that runs them all: MySQL takes a
        /// named lock so that purges run one at a time (`mysql/admin.rs`); nothing elsewhere.
        fn purge_begin(&mut self) -> QueryResult<()> {
            Ok(())
        }
        /// After a purge's steps, whatever they did: undoes `purge_begin`.
        fn purge_end(&mut self) -> QueryResult<()> {
            Ok(())
        }
        /// Purge, step one: the highest token of every counter (`dlock_tokens`) and lease
        /// row (`dlock_leases`) there is, 0 if none: a plain read.
        fn purge_highest(&mut self) -> QueryResult<i64>;
        /// Purge, step two, committed before any delete: raises every bucket of the token
        /// floor (`dlock_token_floor`) to at least `to`. A key without a counter row takes
        /// its first token above its bucket's floor, so a key whose rows a purge deletes
        /// carries on above every token it had.
        fn floor_raise(&mut self, to: i64) -> QueryResult<()>;
        /// Purge, in batches: the `PURGE_BATCH`-th key of `table` after `after` in the
        /// table's key order, or `None` if fewer follow (the last batch runs to the end).
        fn purge_boundary(&mut self, table: PurgeTable, after: &str)
            -> QueryResult<Option<String>>;
        /// Purge, step three, one batch (its own transaction): deletes the rows of `table`
        /// with keys after `after` and up to `upto` (to the end: `None`) that nobody holds,
        /// waits for or counts on, and whose token is at most `highest` (the floor raised
        /// already): `Counters`, counters of keys without a `Row` row; `Leases`, lease rows
        /// free or expired for at least `idle_us`, with no live reader or permit for as long
        /// and no live place in the key's line, each with its key's kind (locked after the
        /// lease row, as every acquisition of a reader or permit locks them). The number
        /// deleted.
        fn purge_batch(
            &mut self,
            table: PurgeTable,
            after: &str,
            upto: Option<&str>,
            highest: i64,
            idle_us: i64,
        ) -> QueryResult<usize>;
    }

    /// The statements of the session strategies, on the backends that have them
    /// ([`Dialect::sessions`]).
    pub trait SessionLocks: super::interrupt::EndSession {
        /// True if `e` means "the lock is held by someone else", reported by a `NOWAIT` or a
        /// bounded server-side wait, as opposed to a real failure.
        fn is_lock_unavailable(&self, e: &diesel::result::Error) -> bool;
        /// ForUpdate, outside any transaction: creates the key's row if it does not exist,
        /// committed at once (an uncommitted row would make other creators wait for us).
        fn for_update_create(&mut self, key: &str) -> QueryResult<()>;
        /// ForUpdate, outside any transaction, after a locking statement on the key's row
        /// found it locked: whether a holder has it. A purge's batch (`Admin::purge_batch`
        /// of `KeyRows`) locks the rows it deletes, and marks itself while it runs (a lock
        /// of its own: PostgreSQL an advisory lock, MySQL a named lock): this waits for a
        /// batch under way to end (bounded), then reads whether the row is still there.
        /// True: the row is there and no purge was deleting it, so a holder has it (busy);
        /// false: the row is gone or a purge was under way, and the caller tries again.
        /// `patience`: how long it may wait for the batch (what is left of the attempt's
        /// one budget for such waits, `for_update::rows`); none left, a batch under way
        /// makes the key busy at once.
        fn for_update_present(
            &mut self,
            key: &str,
            patience: std::time::Duration,
        ) -> QueryResult<bool>;
        /// ForUpdate, inside the transaction the caller opened: locks the key's row, waiting
        /// as `wait` says, and draws a token from a source that a rollback does not undo (a
        /// token drawn by a holder that then died must never be issued again). A busy row is
        /// an error that `is_lock_unavailable` recognises.
        fn for_update_lock(
            &mut self,
            key: &str,
            wait: Wait,
            flavor: Flavor,
        ) -> QueryResult<ForUpdateLocked>;
        /// ForUpdate, inside the holder's transaction: does this transaction still hold the
        /// lock it took with `proof`?
        fn for_update_held(&mut self, key: &str, proof: i64) -> QueryResult<bool>;
        /// ForUpdate, just before COMMIT: undoes whatever only the holder needed (false if the
        /// transaction no longer holds the lock).
        fn for_update_finish(&mut self, proof: i64) -> QueryResult<bool> {
            let _ = proof;
            Ok(true)
        }
        /// Advisory: takes the session-level lock, waiting as `wait` says, and draws a token
        /// (see `fence`), made safe to hand out before it returns. `Ok(None)`: busy, and this
        /// session does not hold the lock (a timeout that raced a grant has been undone).
        /// After an `Err` the session may hold the lock: the caller must discard the
        /// connection.
        fn advisory_lock(&mut self, key: &str, wait: Wait) -> QueryResult<Option<Acquired>>;
        /// Advisory: releases one hold of the lock; false if this session did not hold it.
        fn advisory_unlock(&mut self, key: &str) -> QueryResult<bool>;
        /// Advisory: does this session hold the lock? (AdvisoryXact asks this too, inside
        /// its transaction: the lock shows the same.)
        fn advisory_held(&mut self, key: &str) -> QueryResult<bool>;
        /// AdvisoryXact, inside the transaction the caller opened: takes the
        /// transaction-level advisory lock, waiting as `wait` says, and draws a token (see
        /// `fence`). A bounded wait that times out is an error that `is_lock_unavailable`
        /// recognises; either way the caller rolls back, which frees a lock granted as the
        /// wait timed out. Only PostgreSQL has such locks (`build` refuses the others).
        fn advisory_xact_lock(&mut self, key: &str, wait: Wait) -> QueryResult<XactLocked> {
            let _ = (key, wait);
            Err(diesel::result::Error::QueryBuilderError(
                "transaction-level advisory locks exist on PostgreSQL only".into(),
            ))
        }

        /// This server's flavor; asked once, when a `ForUpdate` `Locker` is built.
        fn flavor(&mut self) -> QueryResult<Flavor> {
            Ok(Flavor::Standard)
        }
        /// Outside any transaction, makes a drawn token safe to hand out (see
        /// `Drawn::checked`): `Some(token)` raises the durable bound past it (committed and
        /// flushed when this returns); `None` starts the server's current life if nobody has
        /// (and makes this session know it). After `None` the caller draws again.
        fn fence_prepare(&mut self, drawn: Option<i64>) -> QueryResult<()>;
        /// A token for a session that holds its lock already, as the acquiring statement
        /// would have drawn it.
        fn fence_draw(&mut self) -> QueryResult<Drawn>;
    }

    /// A held lock as the admin functions read it, with what it takes to remove it.
    #[derive(Debug, Clone)]
    pub struct Held {
        pub info: LockInfo,
        /// `Row`: the row's id. Lease: unused (0).
        pub id: i64,
        /// The holder id (`""` for a `Row` row from before holder ids); `None` for a free lease.
        pub holder: Option<String>,
    }
}

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
