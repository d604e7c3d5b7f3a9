//! `AnyConnection`: one connection type over every enabled backend, for programs that pick
//! the database at run time (the `dlock` CLI does); `open(url)` (the URL read, and one
//! connection opened directly to say why it fails), the pool built for it (`pool`,
//! `connect`), and `Failures`, the pool's last failure to connect with the driver's reason.

use super::sealed::{Dialect, Seal, Sealed};
use super::url::{self, Target};
use super::Backend;
use crate::sync::Unpoison;
use crate::{Error, Result};
use diesel::r2d2::{ConnectionManager, CustomizeConnection, Pool};
use diesel::Connection;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[cfg(not(any(feature = "postgres", feature = "mysql", feature = "sqlite")))]
compile_error!("diesel-lock needs at least one backend feature: sqlite, postgres or mysql");

// diesel's MultiConnection derive cannot take `#[cfg]` on variants, so the enum is written
// once per combination of enabled backends.
macro_rules! any_connection {
    ($($(#[$doc:meta])* $variant:ident($conn:ty)),+ $(,)?) => {
        #[allow(missing_docs, missing_debug_implementations, unreachable_pub)]
        mod generated {
            /// A connection to whichever backend the URL named: a diesel `MultiConnection`
            /// over the backends enabled by this crate's features.
            ///
            /// ```
            /// use diesel::r2d2::{ConnectionManager, Pool};
            /// use diesel_lock::{AnyConnection, Locker};
            ///
            /// # fn main() -> diesel_lock::Result<()> {
            /// # let dir = tempfile::tempdir().unwrap();
            /// # let url = dir.path().join("l.db");
            /// // What `connect` returns; the backend is picked from the URL at run time.
            /// let pool: Pool<ConnectionManager<AnyConnection>> =
            ///     diesel_lock::connect(url.to_str().unwrap())?;
            /// let locker: Locker<AnyConnection> = Locker::builder(pool).build()?;
            /// # Ok(()) }
            /// ```
            #[derive(diesel::MultiConnection)]
            pub enum AnyConnection {
                $($(#[$doc])* $variant($conn)),+
            }
        }
        pub use generated::AnyConnection;
    };
}

#[cfg(all(feature = "postgres", feature = "mysql", feature = "sqlite"))]
any_connection!(
    /// PostgreSQL.
    Postgresql(diesel::PgConnection),
    /// MySQL or MariaDB.
    Mysql(diesel::MysqlConnection),
    /// SQLite.
    Sqlite(diesel::SqliteConnection),
);
#[cfg(all(feature = "postgres", feature = "mysql", not(feature = "sqlite")))]
any_connection!(
    /// PostgreSQL.
    Postgresql(diesel::PgConnection),
    /// MySQL or MariaDB.
    Mysql(diesel::MysqlConnection),
);
#[cfg(all(feature = "postgres", not(feature = "mysql"), feature = "sqlite"))]
any_connection!(
    /// PostgreSQL.
    Postgresql(diesel::PgConnection),
    /// SQLite.
    Sqlite(diesel::SqliteConnection),
);
#[cfg(all(not(feature = "postgres"), feature = "mysql", feature = "sqlite"))]
any_connection!(
    /// MySQL or MariaDB.
    Mysql(diesel::MysqlConnection),
    /// SQLite.
    Sqlite(diesel::SqliteConnection),
);
#[cfg(all(feature = "postgres", not(feature = "mysql"), not(feature = "sqlite")))]
any_connection!(
    /// PostgreSQL.
    Postgresql(diesel::PgConnection),
);
#[cfg(all(not(feature = "postgres"), feature = "mysql", not(feature = "sqlite")))]
any_connection!(
    /// MySQL or MariaDB.
    Mysql(diesel::MysqlConnection),
);
#[cfg(all(not(feature = "postgres"), not(feature = "mysql"), feature = "sqlite"))]
any_connection!(
    /// SQLite.
    Sqlite(diesel::SqliteConnection),
);

/// Runs `$e` with `$c` bound to the concrete connection inside an `AnyConnection`.
macro_rules! each {
    ($conn:expr, $c:ident => $e:expr) => {
        match $conn {
            #[cfg(feature = "postgres")]
            AnyConnection::Postgresql($c) => $e,
            #[cfg(feature = "mysql")]
            AnyConnection::Mysql($c) => $e,
            #[cfg(feature = "sqlite")]
            AnyConnection::Sqlite($c) => $e,
        }
    };
}

impl Sealed for AnyConnection {
    fn dialect(&mut self, seal: Seal) -> &mut dyn Dialect {
        each!(self, c => c.dialect(seal))
    }

    fn static_backend(_: Seal) -> Option<Backend> {
        None
    }
}

/// Applies [`SqliteTuning`](crate::SqliteTuning) to the SQLite connections of an
/// `AnyConnection` pool, and `autocommit = 1` to MySQL ones; turns diesel's prepared-statement
/// cache off on PostgreSQL connections through a transaction pooler (`dlock_pooler`), and
/// in a `Locker`'s own pool puts PostgreSQL sessions reached directly at READ COMMITTED. A
/// connection that opens clears the pool's last connection failure.
#[derive(Debug)]
struct AnyTuning {
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    behind_pooler: bool,
    /// A pool only a `Locker` uses (`Locker::connect`): its PostgreSQL sessions run at READ
    /// COMMITTED whatever the database's default, as the line's statements need.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    read_committed: bool,
    failures: Arc<Failures>,
}

impl CustomizeConnection<AnyConnection, diesel::r2d2::Error> for AnyTuning {
    fn on_acquire(&self, conn: &mut AnyConnection) -> Result<(), diesel::r2d2::Error> {
        let tuned = match conn {
            // Named prepared statements live in one server session, which a transaction
            // pooler hands to other clients between transactions: without the cache diesel
            // sends each statement with its parameters in one message (PQsendQueryParams),
            // which any server session can run.
            #[cfg(feature = "postgres")]
            AnyConnection::Postgresql(c) if self.behind_pooler => {
                c.set_prepared_statement_cache_size(diesel::connection::CacheSize::Disabled);
                Ok(())
            }
            // The line's statements need READ COMMITTED: at REPEATABLE READ they meet
            // serialization failures, and newcomers passed earlier waiters meanwhile (an
            // adversary, 28 Nov); at SERIALIZABLE a `ForUpdate` holder's check was aborted.
            // A session setting: never through a transaction pooler, where it would stay on
            // a server session that other clients are given next.
            #[cfg(feature = "postgres")]
            AnyConnection::Postgresql(c) if self.read_committed => {
                use diesel::connection::SimpleConnection;
                c.batch_execute(
                    "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL READ COMMITTED",
                )
                .map_err(diesel::r2d2::Error::QueryError)
            }
            #[cfg(feature = "sqlite")]
            AnyConnection::Sqlite(c) => super::SqliteTuning::default()
                .apply(c)
                .map_err(diesel::r2d2::Error::QueryError),
            // Every statement outside an explicit transaction must commit at once; a server
            // configured with autocommit=0 would leave rows uncommitted (and locked) on a
            // pooled connection.
            #[cfg(feature = "mysql")]
            AnyConnection::Mysql(c) => {
                use diesel::connection::SimpleConnection;
                c.batch_execute("SET SESSION autocommit = 1")
                    .map_err(diesel::r2d2::Error::QueryError)
            }
            #[allow(unreachable_patterns)]
            _ => Ok(()),
        };
        if tuned.is_ok() {
            self.failures.clear();
        }
        tuned
    }
}

/// Opens one connection to `target`'s backend directly: diesel's `MultiConnection` tries
/// every backend in turn and keeps none of their errors, so its failure never says why.
fn establish(target: &Target) -> Result<(), diesel::ConnectionError> {
    match target.backend {
        #[cfg(feature = "postgres")]
        Backend::Postgres => diesel::PgConnection::establish(&target.url).map(drop),
        #[cfg(feature = "mysql")]
        Backend::Mysql => diesel::MysqlConnection::establish(&target.url).map(drop),
        #[cfg(feature = "sqlite")]
        Backend::Sqlite => diesel::SqliteConnection::establish(&target.url).map(drop),
        #[allow(unreachable_patterns)]
        _ => Err(diesel::ConnectionError::InvalidConnectionUrl(
            "this build does not include that backend".into(),
        )),
    }
}

/// Reads `url` and opens one connection to it, so that a wrong URL, a wrong password or a
/// server that is down fails at once with the driver's reason (passwords masked).
pub(crate) fn open(url: &str) -> Result<Target> {
    let target = url::parse(url)?;
    establish(&target).map_err(|e| Error::from(target.secrets.scrub_connection(e)))?;
    Ok(target)
}

/// The pool for `target`: `size` connections at most, waiting at most 10 s for one, its
/// connection failures kept (with the driver's reason) in `failures`.
fn pool(
    target: &Target,
    size: u32,
    failures: Arc<Failures>,
) -> Result<Pool<ConnectionManager<AnyConnection>>> {
    build_pool(target, size, failures, false)
}

/// A `Locker`'s own pool (`Locker::connect`): as [`pool`], and its PostgreSQL sessions
/// reached directly run at READ COMMITTED (`AnyTuning::read_committed`).
pub(crate) fn locker_pool(
    target: &Target,
    size: u32,
    failures: Arc<Failures>,
) -> Result<Pool<ConnectionManager<AnyConnection>>> {
    build_pool(target, size, failures, true)
}

fn build_pool(
    target: &Target,
    size: u32,
    failures: Arc<Failures>,
    own: bool,
) -> Result<Pool<ConnectionManager<AnyConnection>>> {
    if size == 0 {
        return Err(Error::InvalidConfig(
            "the pool needs at least 1 connection".into(),
        ));
    }
    Pool::builder()
        .max_size(size)
        // No idle minimum: r2d2 refills idle connections on a background thread, and a refill
        // still connecting when a short-lived program exits can crash in libpq's TLS code.
        .min_idle(Some(0))
        .connection_timeout(CONNECTION_TIMEOUT)
        // r2d2 tests a connection it hands out (`SELECT 1`) in case the server closed it
        // meanwhile. A SQLite connection is the database file opened in this process: it
        // cannot have been closed by anyone, and the test was a statement more per checkout
        // (three per hand-over across processes).
        .test_on_check_out(!matches!(target.backend, Backend::Sqlite))
        .connection_customizer(Box::new(AnyTuning {
            behind_pooler: target.behind_pooler,
            read_committed: own && !target.behind_pooler,
            failures: failures.clone(),
        }))
        .error_handler(Box::new(ReportErrors(failures)))
        .build(ConnectionManager::new(target.url.clone()))
        .map_err(Error::Pool)
}

/// How long a pool the library builds waits for a connection.
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(10);

/// Builds a connection pool for `url`: `postgres://…` or `postgresql://…`, `mysql://…` (or
/// `mariadb://…`), `sqlite://PATH` or a plain file path (SQLite). The scheme decides the
/// backend; a URL meant for a server but mistyped (`postgres:/…`, `user:pw@host` without a
/// scheme) is refused rather than taken for a file name. One connection is opened first, so
/// a wrong URL or an unreachable server fails at once with the driver's reason (the URL's
/// password masked in it).
///
/// For a [`Locker`](crate::Locker), [`Locker::connect`](crate::Locker::connect) is the better
/// door: the pool it builds keeps the driver's reason for every later connection failure
/// (a pool built here reports them as r2d2's bare timeout), and on PostgreSQL the `Locker`
/// knows the URL to listen on for releases. Use this one for a pool of your own, for your
/// application's queries or to share between several `Locker`s.
///
/// SQLite connections get [`SqliteTuning`](crate::SqliteTuning). A PostgreSQL URL with the
/// query parameter `dlock_pooler=transaction` goes through a transaction-pooling PgBouncer
/// (or a pooler like it): the parameter is taken out of the URL before libpq sees it, and
/// the pool's connections run without diesel's cache of named prepared statements, which
/// such a pooler breaks (docs/guide.md, "Behind a connection pooler": which strategies work
/// there). The pool holds at most 10 connections unless the URL says
/// `dlock_pool_size=N` (taken out too), and waits at most 10 s for one. It tests a server's
/// connection before handing it out (r2d2's `SELECT 1`), not a SQLite one (the file opened
/// in this process, which nothing else can close). Its failures to
/// connect (a database restarting, say) are logged at `warn` at most once per 10 s, the rest
/// at `debug`.
///
/// The pool's connections are [`AnyConnection`]s, diesel `MultiConnection`s: diesel's query
/// builder works on them, but raw `sql_query` with bind parameters does not on PostgreSQL
/// (see the crate docs, "Your own queries").
///
/// ```
/// # fn main() -> diesel_lock::Result<()> {
/// # let dir = tempfile::tempdir().unwrap();
/// # let path = dir.path().join("locks.db");
/// let pool = diesel_lock::connect(&format!("{}?dlock_pool_size=4", path.display()))?;
/// assert_eq!(pool.max_size(), 4);
/// let locker = diesel_lock::Locker::builder(pool).build()?;
/// locker.migrate()?;
/// # Ok(()) }
/// ```
///
/// # Errors
/// [`Error::InvalidUrl`] for an empty or malformed URL, an unknown scheme, a backend this
/// build lacks (naming the Cargo feature to turn on), or an in-memory SQLite database;
/// [`Error::Connection`] if the first connection fails; [`Error::Pool`] if the pool cannot
/// be built.
pub fn connect(url: &str) -> Result<Pool<ConnectionManager<AnyConnection>>> {
    let target = open(url)?;
    let size = target.pool_size.unwrap_or(url::DEFAULT_POOL_SIZE);
    pool(&target, size, Arc::new(Failures::new(target.clone())))
}

/// A pool's last connection failure, with the driver's reason, for the errors of a `Locker`
/// that cannot get a connection (r2d2 keeps only diesel's "Invalid connection url for
/// multiconnection", and gives it to one caller). Written by the pool's error handler,
/// cleared by the next connection that opens.
pub(crate) struct Failures {
    target: Target,
    last: Mutex<Option<(Instant, String)>>,
    last_warned: Mutex<Option<Instant>>,
}

impl std::fmt::Debug for Failures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Failures").finish_non_exhaustive()
    }
}

impl Failures {
    pub(crate) fn new(target: Target) -> Self {
        Failures {
            target,
            last: Mutex::new(None),
            last_warned: Mutex::new(None),
        }
    }

    /// The error of the pool's last failure to connect, if one came within `within` (and
    /// none has opened since).
    pub(crate) fn recent(&self, within: Duration) -> Option<Error> {
        let last = self.last.lock().unpoisoned();
        let (at, message) = last.as_ref()?;
        (at.elapsed() <= within)
            .then(|| Error::from(diesel::ConnectionError::BadConnection(message.clone())))
    }

    fn clear(&self) {
        *self.last.lock().unpoisoned() = None;
    }

    /// Keeps the reason of a failure to connect; learns it by connecting directly when the
    /// error is diesel's `MultiConnection` one, which says nothing (at most once a second:
    /// r2d2 retries every 200 ms or more during an outage).
    fn record(&self, e: &diesel::r2d2::Error) {
        // A pooled connection found dead when checked out (a `QueryError`) says nothing of
        // why new ones cannot be opened.
        let diesel::r2d2::Error::ConnectionError(e) = e else {
            return;
        };
        let told = e.to_string();
        let message = if told.contains("multiconnection") {
            let fresh = self
                .last
                .lock()
                .unpoisoned()
                .as_ref()
                .is_some_and(|(at, _)| at.elapsed() < Duration::from_secs(1));
            if fresh {
                if let Some((at, _)) = self.last.lock().unpoisoned().as_mut() {
                    *at = Instant::now();
                }
                return;
            }
            match establish(&self.target) {
                Err(e) => e.to_string(),
                // It answers now: the next attempt of the pool's will connect.
                Ok(()) => return,
            }
        } else {
            told
        };
        let message = self.target.secrets.scrub(&message);
        *self.last.lock().unpoisoned() = Some((Instant::now(), message));
    }

    /// True for the first error in 10 s (which then starts the next 10 s).
    fn time_to_warn(&self) -> bool {
        let mut last = self.last_warned.lock().unpoisoned();
        if last.is_some_and(|t| t.elapsed() < Duration::from_secs(10)) {
            return false;
        }
        *last = Some(Instant::now());
        true
    }
}

/// The pool's connection errors: their reason kept in `Failures`, and logged at `warn` at
/// most once per 10 s and at `debug` in between: r2d2's default handler logs every failed
/// attempt at `error`, a line every few hundred milliseconds per pool while a database
/// restarts. Callers hear of an outage from the calls that fail, and waits log it once.
#[derive(Debug)]
struct ReportErrors(Arc<Failures>);

impl r2d2::HandleError<diesel::r2d2::Error> for ReportErrors {
    fn handle_error(&self, e: diesel::r2d2::Error) {
        self.0.record(&e);
        let recorded = || {
            self.0
                .last
                .lock()
                .unpoisoned()
                .as_ref()
                .map(|(_, m)| m.clone())
        };
        let why = match &e {
            diesel::r2d2::Error::ConnectionError(_) => recorded(),
            diesel::r2d2::Error::QueryError(_) => None,
        }
        .unwrap_or_else(|| self.0.target.secrets.scrub(&e.to_string()));
        let why = why.split_whitespace().collect::<Vec<_>>().join(" ");
        if self.0.time_to_warn() {
            log::warn!(
                "database connection failed: {why} (repeats within 10 s are logged at debug)"
            );
        } else {
            log::debug!("database connection failed: {why}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A storm of connection errors makes one warning, not one per error.
    #[test]
    fn connection_errors_warn_once_per_interval() {
        let quiet = Failures::new(url::parse("x.db").unwrap());
        let warned: Vec<bool> = (0..5).map(|_| quiet.time_to_warn()).collect();
        assert_eq!(warned, [true, false, false, false, false]);
        // Ten seconds on, the next one warns again.
        *quiet.last_warned.lock().unwrap() = Instant::now().checked_sub(Duration::from_secs(11));
        assert!(quiet.time_to_warn());
    }

    /// diesel's MultiConnection error says nothing: the pool's failures keep the driver's
    /// own reason instead, masked, until a connection opens.
    #[cfg(feature = "sqlite")]
    #[test]
    fn a_failure_keeps_the_drivers_reason() {
        let failures = Failures::new(url::parse("/nonexistent-dir/x.db").unwrap());
        failures.record(&diesel::r2d2::Error::ConnectionError(
            diesel::ConnectionError::BadConnection(
                "Invalid connection url for multiconnection".into(),
            ),
        ));
        let e = failures.recent(Duration::from_secs(10)).unwrap();
        assert!(
            matches!(
                e,
                Error::Connection {
                    failure: crate::ConnectFailure::CannotOpen,
                    ..
                }
            ),
            "{e:?}"
        );
        failures.clear();
        assert!(failures.recent(Duration::from_secs(10)).is_none());
    }
}
