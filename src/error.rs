//! The crate's one error type.

use std::fmt;

/// `Result` with [`Error`] as the default error type.
///
/// ```
/// use diesel_lock::{AnyConnection, Locker};
///
/// fn run_once(locker: &Locker<AnyConnection>) -> diesel_lock::Result<bool> {
///     let Some(guard) = locker.try_lock("nightly-report")? else {
///         return Ok(false); // another process is running it
///     };
///     // ... the work ...
///     guard.release()?;
///     Ok(true)
/// }
/// # fn main() -> diesel_lock::Result<()> {
/// # let dir = tempfile::tempdir().unwrap();
/// # let locker = Locker::builder(diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?).build()?;
/// # locker.migrate()?;
/// assert!(run_once(&locker)?);
/// # Ok(()) }
/// ```
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong while taking, keeping or releasing a lock.
///
/// "Someone else holds the key" is not an error: `try_lock` and `try_lock_for` return
/// `Ok(None)` for it. Database deadlocks and lock-wait timeouts met while *competing* for a
/// key are contention too, and are retried or reported as `Ok(None)`, never as an error.
///
/// ```
/// use diesel_lock::{Error, Locker};
///
/// # fn main() -> diesel_lock::Result<()> {
/// # let dir = tempfile::tempdir().unwrap();
/// # let pool = diesel_lock::connect(dir.path().join("l.db").to_str().unwrap())?;
/// let locker = Locker::builder(pool).build()?; // (no `migrate` yet)
/// let outcome = match locker.try_lock("report") {
///     Ok(Some(_guard)) => "ran",
///     Ok(None) => "busy", // contention is not an error
///     Err(Error::MissingTable(_)) => "run `dlock migrate` first",
///     Err(Error::Pool(_) | Error::Connection { .. } | Error::Unreachable { .. }) => {
///         "database unreachable, try later"
///     }
///     Err(e) => return Err(e), // the enum is non-exhaustive
/// };
/// assert_eq!(outcome, "run `dlock migrate` first");
/// # Ok(()) }
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// The key is empty, longer than 255 bytes, or contains a NUL byte.
    InvalidKey {
        /// Why the key was refused.
        reason: &'static str,
    },
    /// The builder was given a value that cannot work (a zero TTL, an empty owner, ...).
    InvalidConfig(String),
    /// The strategy cannot be honoured faithfully by this backend (e.g. `ForUpdate` on SQLite).
    Unsupported {
        /// The strategy that was asked for.
        strategy: &'static str,
        /// The backend that cannot provide it.
        backend: &'static str,
    },
    /// The library's tables do not exist, or are older than this version of the library
    /// (a `Locker` checks once, at its first acquisition, that the newest migration it knows
    /// is applied; a column a later migration adds is missing): call
    /// [`Locker::migrate`](crate::Locker::migrate). Also what a process sees while another
    /// is still migrating on MySQL, whose DDL commits statement by statement: `migrate()`
    /// then waits for that migration to finish.
    MissingTable(diesel::result::Error),
    /// The lock is no longer held by this guard: its lease expired, its row was taken over
    /// as stale, or its session ended.
    LockLost {
        /// The key whose lock was lost.
        key: String,
    },
    /// An optimistic transaction saw its version change on every attempt.
    Conflict {
        /// The key whose version kept changing.
        key: String,
        /// How many attempts were made.
        attempts: u32,
    },
    /// No connection could be had from the pool in time (exhausted, or a database that
    /// could not be reached when the pool does not know why: a pool built by hand).
    Pool(r2d2::Error),
    /// No connection could be had from the pool: all of its `size` connections were in use,
    /// `held_by_guards` of them by this `Locker`'s own guards (a `ForUpdate` or
    /// `AdvisoryXact` guard keeps one for its whole life; `Advisory` guards share a few, at
    /// most half the pool, and a guard whose lock was won by a wait once those are all open
    /// keeps its own). Size the
    /// pool with [`LockerBuilder::pool_size`](crate::LockerBuilder::pool_size) or the URL's
    /// `dlock_pool_size`, or hold fewer guards at once.
    PoolExhausted {
        /// The pool's size.
        size: u32,
        /// How many of its connections this `Locker`'s guards hold.
        held_by_guards: usize,
    },
    /// A database error that is not contention.
    Database(diesel::result::Error),
    /// Opening a connection failed: `failure` says why in a word, the source is the
    /// driver's own message (with the URL's password masked).
    Connection {
        /// Why, as far as the driver's message tells.
        failure: ConnectFailure,
        /// The driver's error.
        source: diesel::ConnectionError,
    },
    /// A wait gave up at its deadline while its last attempts could not reach the database
    /// (a server down or restarting, a network cut): unlike `Ok(None)`, this does not mean
    /// that another process holds the key. A last attempt that only lost its connection (a
    /// session ended by the server or an administrator) is followed by one more on another
    /// connection, so a database that answers that one does not make a wait end so. The
    /// source is the last attempt's error.
    Unreachable {
        /// The key waited for.
        key: String,
        /// Why the last attempt failed.
        source: Box<Error>,
    },
    /// Running the embedded migrations failed.
    Migration(Box<dyn std::error::Error + Send + Sync>),
    /// A database URL could not be understood.
    InvalidUrl(String),
    /// A thread the `Locker` needs could not be started (the operating system refused:
    /// too many threads, no memory).
    Thread(std::io::Error),
    /// A semaphore was asked for with another number of permits than its key was created
    /// with (the first acquisition fixes it), or a reader-writer key as a semaphore, or the
    /// reverse. The key's kind never changes silently.
    Permits {
        /// The key.
        key: String,
        /// The permits stored with the key; 0 for a reader-writer key.
        stored: u32,
        /// The permits asked for; 0 for a reader or a writer.
        asked: u32,
    },
    /// A kind of lock that the strategy and backend could not make exclude the key's other
    /// kinds, refused rather than handed out beside them (a semaphore permit of `Advisory`
    /// on MySQL, whose `GET_LOCK` has no shared mode). `reason` says which and what to use.
    Incompatible {
        /// The key.
        key: String,
        /// What was refused, why, and what to do.
        reason: String,
    },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::InvalidKey { reason } => write!(f, "invalid lock key: {reason}"),
            Error::InvalidConfig(why) => write!(f, "invalid lock configuration: {why}"),
            Error::Unsupported { strategy, backend } => {
                write!(f, "the {strategy} strategy is not supported on {backend}")
            }
            Error::MissingTable(_) => write!(
                f,
                "the lock tables do not exist or are older than this version: run Locker::migrate() or `dlock migrate` first"
            ),
            Error::LockLost { key } => write!(f, "the lock on {key:?} was lost"),
            Error::Conflict { key, attempts } => write!(
                f,
                "the version of {key:?} changed under every one of {attempts} attempts"
            ),
            Error::Pool(_) => write!(f, "no database connection could be had from the pool"),
            Error::PoolExhausted { size, held_by_guards: 0 } => write!(
                f,
                "no database connection could be had: the pool's {size} connections are all in use \
                 (size the pool with LockerBuilder::pool_size or dlock_pool_size=N in the url)"
            ),
            Error::PoolExhausted { size, held_by_guards } => write!(
                f,
                "no database connection could be had: the pool's {size} connections are in use, \
                 {held_by_guards} of them by this Locker's guards (ForUpdate and AdvisoryXact \
                 guards keep one each, Advisory guards share a few); size the pool with LockerBuilder::pool_size \
                 or dlock_pool_size=N in the url, or hold fewer guards at once"
            ),
            Error::Database(_) => write!(f, "database error"),
            Error::Connection {
                failure: ConnectFailure::Other,
                ..
            } => write!(f, "could not connect to the database"),
            Error::Connection { failure, .. } => {
                write!(f, "could not connect to the database: {failure}")
            }
            Error::Unreachable { key, .. } => write!(
                f,
                "gave up waiting for {key:?}: the database could not be reached"
            ),
            Error::Migration(_) => write!(f, "could not create or upgrade the lock tables"),
            Error::InvalidUrl(why) => write!(f, "invalid database url: {why}"),
            Error::Thread(_) => write!(f, "could not start a thread"),
            Error::Permits { key, stored: 0, asked } => write!(
                f,
                "{key:?} is a reader-writer lock, not a semaphore of {asked} permits: a key is \
                 one or the other, so use another key for the semaphore"
            ),
            Error::Permits { key, stored, asked: 0 } => write!(
                f,
                "{key:?} is a semaphore of {stored} permits, not a reader-writer lock: a key is \
                 one or the other, so use another key for the readers"
            ),
            Error::Permits { key, stored, asked } => write!(
                f,
                "the semaphore {key:?} has {stored} permits, not {asked}: its first acquisition \
                 fixed the number"
            ),
            Error::Incompatible { key, reason } => write!(f, "lock {key:?}: {reason}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::MissingTable(e) | Error::Database(e) => Some(e),
            Error::Pool(e) => Some(e),
            Error::Connection { source, .. } => Some(source),
            Error::Unreachable { source, .. } => Some(&**source),
            Error::Migration(e) => Some(&**e),
            Error::Thread(e) => Some(e),
            _ => None,
        }
    }
}

impl From<diesel::result::Error> for Error {
    fn from(e: diesel::result::Error) -> Self {
        if is_missing_table(&e) {
            Error::MissingTable(e)
        } else {
            Error::Database(e)
        }
    }
}

impl From<r2d2::Error> for Error {
    fn from(e: r2d2::Error) -> Self {
        Error::Pool(e)
    }
}

impl From<diesel::ConnectionError> for Error {
    fn from(e: diesel::ConnectionError) -> Self {
        Error::Connection {
            failure: ConnectFailure::of(&e.to_string()),
            source: e,
        }
    }
}

/// Why a connection could not be opened, as far as the driver's message tells: the
/// [`Error::Connection`] of a wrong URL, a wrong password or a server that is down.
///
/// ```
/// use diesel_lock::{ConnectFailure, Error, Locker};
///
/// # fn main() -> diesel_lock::Result<()> {
/// // A SQLite file in a directory that does not exist:
/// match Locker::connect("/nonexistent-dir/locks.db") {
///     Err(Error::Connection { failure, source }) => {
///         assert_eq!(failure, ConnectFailure::CannotOpen);
///         assert!(source.to_string().contains("Unable to open the database file"));
///     }
///     other => panic!("{other:?}"),
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConnectFailure {
    /// Nothing accepts connections at that address and port: connection refused (or no
    /// route to the host).
    Refused,
    /// The server refused the user name or the password (or has no such user).
    Authentication,
    /// The server has no database of that name (MySQL: or none of that name that this user
    /// may use; it says the same of both).
    UnknownDatabase,
    /// TLS was required, by the URL or by the server, and could not be had. (MariaDB words
    /// a refusal of a connection without TLS as it words a wrong password, "Access denied":
    /// that one is `Authentication`.)
    TlsRequired,
    /// SQLite: the database file could not be opened or created.
    CannotOpen,
    /// Anything else: the error's source says what.
    Other,
}

impl ConnectFailure {
    /// Reads a driver's message (libpq, the MySQL/MariaDB client, SQLite).
    pub(crate) fn of(message: &str) -> Self {
        let m = message.to_ascii_lowercase();
        let has = |t: &[&str]| t.iter().any(|t| m.contains(t));
        if has(&[
            "ssl was required",
            "ssl is required",
            "ssl connection is required",
            "tls/ssl error",
            "ssl connection error",
            "requires secure transport",
            "insecure transport are prohibited",
        ]) || m.contains("no pg_hba.conf entry") && m.contains("no encryption")
        {
            ConnectFailure::TlsRequired
        } else if has(&[
            "connection refused",
            "can't connect to",
            "no route to host",
            "network is unreachable",
        ]) {
            ConnectFailure::Refused
        } else if m.contains("unknown database")
            || m.contains("database \"") && m.contains("does not exist")
            // MySQL says the same of a database that does not exist and of one the user may
            // not use, once the password was accepted.
            || m.contains("access denied for user") && m.contains("to database")
        {
            ConnectFailure::UnknownDatabase
        } else if has(&[
            "password authentication failed",
            "authentication failed",
            "no password supplied",
            "no pg_hba.conf entry",
            "access denied for user",
        ]) || m.contains("role \"") && m.contains("does not exist")
        {
            ConnectFailure::Authentication
        } else if has(&["unable to open"]) {
            ConnectFailure::CannotOpen
        } else {
            ConnectFailure::Other
        }
    }
}

impl fmt::Display for ConnectFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ConnectFailure::Refused => "connection refused",
            ConnectFailure::Authentication => "authentication failed",
            ConnectFailure::UnknownDatabase => "unknown database",
            ConnectFailure::TlsRequired => "TLS required",
            ConnectFailure::CannotOpen => "cannot open the database file",
            ConnectFailure::Other => "the driver's error follows",
        })
    }
}

/// Whether `e` says the connection died or the server is going away or not back yet (a
/// server restarting, crashing or shutting down, a network cut), as opposed to a statement
/// that failed on a working connection. A wait already under way rides such errors out until
/// its deadline (`Locker` waiting); nothing else retries them.
pub(crate) fn is_connection_lost(e: &Error) -> bool {
    use diesel::result::{DatabaseErrorKind, Error as D};
    match e {
        Error::Database(D::DatabaseError(DatabaseErrorKind::ClosedConnection, _)) => true,
        Error::Database(D::DatabaseError(_, info)) => {
            let m = info.message().to_ascii_lowercase();
            CONNECTION_LOST.iter().any(|t| m.contains(t))
        }
        _ => false,
    }
}

/// What the servers and client libraries say when the connection is gone or the server is
/// going away or not back yet (lower case; matched as substrings).
const CONNECTION_LOST: [&str; 11] = [
    // PostgreSQL (57P01 admin_shutdown, 57P03 cannot_connect_now) and libpq
    "terminating connection due to administrator command",
    "the database system is shutting down",
    "the database system is starting up",
    "the database system is in recovery mode",
    "server closed the connection unexpectedly",
    "no connection to the server",
    "could not receive data from server",
    // MySQL / MariaDB (1053, 2006, 2013, 1927) and their client library
    "server shutdown in progress",
    "server has gone away",
    "lost connection to",
    "connection was killed",
];

/// The three backends word "table not found" differently and diesel maps none of them to a
/// kind of its own, so the message is matched. Only our own tables (`dlock_` prefix) count,
/// and the columns that later migrations added to them: a database migrated by an older
/// version (or by a process still migrating it) lacks those.
pub(crate) fn is_missing_table(e: &diesel::result::Error) -> bool {
    let diesel::result::Error::DatabaseError(_, info) = e else {
        return false;
    };
    let m = info.message();
    let table = m.contains("dlock_")
        && (m.contains("does not exist") // PostgreSQL: relation "dlock_rows" does not exist
            || m.contains("doesn't exist") // MySQL: Table 'db.dlock_rows' doesn't exist
            || m.contains("no such table")); // SQLite: no such table: dlock_rows
    table || LATER_COLUMNS.iter().any(|c| is_missing_column(m, c))
}

/// The columns added by migrations after the first, to tables that existed before.
const LATER_COLUMNS: [&str; 6] = [
    "holder",
    "stale_at",
    "holder_id",
    "shared_until",
    "permit_count",
    "created_at",
];

fn is_missing_column(m: &str, column: &str) -> bool {
    // PostgreSQL: column "stale_at" (of relation "dlock_rows") does not exist
    m.starts_with(&format!("column \"{column}\"")) && m.contains("does not exist")
        // MySQL: Unknown column 'stale_at' in 'WHERE'
        || m.starts_with(&format!("Unknown column '{column}'"))
        // SQLite: table dlock_rows has no column named stale_at / no such column: stale_at
        || m.contains("dlock_") && m.ends_with(&format!("has no column named {column}"))
        || m == format!("no such column: {column}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lost_connection_is_told_from_a_failed_statement() {
        use diesel::result::{DatabaseErrorKind as K, Error as D};
        let db = |kind, m: &str| Error::Database(D::DatabaseError(kind, Box::new(m.to_owned())));
        for lost in [
            db(
                K::ClosedConnection,
                "server closed the connection unexpectedly",
            ),
            db(
                K::Unknown,
                "terminating connection due to administrator command",
            ),
            db(K::Unknown, "Server has gone away"),
            db(K::Unknown, "MySQL server has gone away"),
            db(K::Unknown, "Lost connection to server during query"),
            db(K::Unknown, "Server shutdown in progress"),
        ] {
            assert!(is_connection_lost(&lost), "{lost:?}");
        }
        for real in [
            db(K::Unknown, "canceling statement due to lock timeout"),
            db(
                K::UniqueViolation,
                "duplicate key value violates unique constraint",
            ),
            db(K::Unknown, "relation \"dlock_rows\" does not exist"),
            Error::LockLost { key: "k".into() },
        ] {
            assert!(!is_connection_lost(&real), "{real:?}");
        }
    }

    #[test]
    fn drivers_messages_are_read() {
        use ConnectFailure as F;
        for (m, f) in [
            ("connection to server at \"127.0.0.1\", port 1 failed: Connection refused\n\tIs the server running on that host and accepting TCP/IP connections?", F::Refused),
            ("Can't connect to server on '127.0.0.1' (111)", F::Refused),
            ("Can't connect to MySQL server on '127.0.0.1:1' (111)", F::Refused),
            ("Can't connect to server on '127.0.0.1' (115)", F::Refused),
            ("connection to server at \"127.0.0.1\", port 5432 failed: FATAL:  role \"nobody\" does not exist", F::Authentication),
            ("connection to server at \"127.0.0.1\", port 5432 failed: FATAL:  password authentication failed for user \"dlock\"", F::Authentication),
            ("Access denied for user 'dlock'@'localhost' (using password: YES)", F::Authentication),
            ("connection to server at \"127.0.0.1\", port 5432 failed: FATAL:  database \"nope\" does not exist", F::UnknownDatabase),
            ("Unknown database 'nope'", F::UnknownDatabase),
            ("Access denied for user 'dlock'@'127.0.0.1' to database 'nope'", F::UnknownDatabase),
            ("connection to server at \"127.0.0.1\", port 5432 failed: server does not support SSL, but SSL was required", F::TlsRequired),
            ("Connections using insecure transport are prohibited while --require_secure_transport=ON.", F::TlsRequired),
            ("Unable to open the database file", F::CannotOpen),
            ("could not translate host name \"nohost\" to address", F::Other),
        ] {
            assert_eq!(ConnectFailure::of(m), f, "{m}");
        }
    }

    #[test]
    fn errors_are_send_sync_static() {
        fn assert<T: Send + Sync + 'static + std::error::Error>() {}
        assert::<Error>();
    }

    #[test]
    fn display_is_lowercase() {
        let samples = [
            Error::InvalidKey { reason: "empty" },
            Error::InvalidConfig("ttl is zero".into()),
            Error::LockLost { key: "k".into() },
            Error::Database(diesel::result::Error::NotFound),
        ];
        for e in samples {
            let s = e.to_string();
            assert!(s.chars().next().unwrap().is_lowercase(), "{s}");
        }
    }
}
