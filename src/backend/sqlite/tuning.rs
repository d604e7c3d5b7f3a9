//! `SqliteTuning`: the per-connection settings of SQLite pools.

use diesel::connection::SimpleConnection;
use diesel::r2d2::CustomizeConnection;
use diesel::sqlite::SqliteConnection;
use diesel::QueryResult;

/// Per-connection settings for SQLite pools: WAL journal, a 5 s `busy_timeout`, and
/// `synchronous = NORMAL` (the default) or `FULL`.
///
/// The short writes of the waiters' line (a place taken, renewed or given up, a hand-over,
/// its confirmation) wait for the database's write lock in steps of microseconds instead of
/// the busy handler's 1 ms and more, for as long as the connection's `busy_timeout` (whatever
/// it is; the handler is off during such a transaction and put back after it).
///
/// [`connect`](crate::connect) installs it; a pool you build yourself needs it too (or the
/// same settings by other means): [`LockerBuilder::build`](crate::LockerBuilder::build)
/// refuses a SQLite pool without WAL and a busy timeout, with which a lock's commit could
/// fail after its statement had returned the lock:
///
/// ```
/// use diesel::r2d2::{ConnectionManager, Pool};
/// use diesel::SqliteConnection;
/// use diesel_lock::SqliteTuning;
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let dir = tempfile::tempdir()?;
/// # let path = dir.path().join("locks.db");
/// let pool = Pool::builder()
///     .connection_customizer(Box::new(SqliteTuning::default()))
///     .build(ConnectionManager::<SqliteConnection>::new(path.to_str().unwrap()))?;
/// # Ok(()) }
/// ```
///
/// # Durability
/// With `NORMAL` in WAL mode a commit is not fsynced until the next checkpoint: after a power
/// loss (not a process crash) the last acquisitions and releases may be rolled back, so a
/// released lock may reappear as held (a `Row` lock without `stale_after` then stays held
/// until removed by hand) and a token may be issued twice. Measured on this project's
/// machines: 22,022 vs 3,951 acquire+release cycles/s, and `FULL` starved waiters (one thread
/// 1 acquisition, another 9,338). Choose [`SqliteTuning::durable`] where power-loss
/// durability matters more.
#[derive(Debug, Clone, Copy, Default)]
pub struct SqliteTuning {
    durable: bool,
}

impl SqliteTuning {
    /// WAL, `busy_timeout = 5000`, `synchronous = FULL`: every commit is fsynced.
    ///
    /// ```
    /// use diesel::r2d2::{ConnectionManager, Pool};
    /// use diesel_lock::SqliteTuning;
    ///
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let path = dir.path().join("l.db");
    /// let pool = Pool::builder()
    ///     .connection_customizer(Box::new(SqliteTuning::durable()))
    ///     .build(ConnectionManager::<diesel::SqliteConnection>::new(path.to_str().unwrap()))?;
    /// let locker = diesel_lock::Locker::builder(pool).build()?;
    /// locker.migrate()?;
    /// # Ok(()) }
    /// ```
    pub fn durable() -> Self {
        SqliteTuning { durable: true }
    }

    fn pragmas(&self) -> &'static str {
        if self.durable {
            "PRAGMA busy_timeout = 5000; PRAGMA journal_mode = WAL; PRAGMA synchronous = FULL;"
        } else {
            "PRAGMA busy_timeout = 5000; PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL;"
        }
    }
}

impl CustomizeConnection<SqliteConnection, diesel::r2d2::Error> for SqliteTuning {
    fn on_acquire(&self, conn: &mut SqliteConnection) -> Result<(), diesel::r2d2::Error> {
        conn.batch_execute(self.pragmas())
            .map_err(diesel::r2d2::Error::QueryError)
    }
}

impl SqliteTuning {
    pub(crate) fn apply(&self, conn: &mut SqliteConnection) -> QueryResult<()> {
        conn.batch_execute(self.pragmas())
    }
}
