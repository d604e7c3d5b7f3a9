//! `AnyConnection`: one connection type over every enabled backend, for programs that pick
//! the database at run time (the `dlock` CLI does), and `connect(url)` to build its pool.

use super::sealed::{Dialect, Seal, Sealed};
use super::Backend;
use crate::sync::Unpoison;
use crate::{Error, Result};
use diesel::r2d2::{ConnectionManager, CustomizeConnection, Pool};
use diesel::Connection;
use std::time::Duration;

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
/// cache off on PostgreSQL connections through a transaction pooler (`dlock_pooler`).
#[derive(Debug, Clone, Copy)]
struct AnyTuning {
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    behind_pooler: bool,
}

impl CustomizeConnection<AnyConnection, diesel::r2d2::Error> for AnyTuning {
    fn on_acquire(&self, conn: &mut AnyConnection) -> Result<(), diesel::r2d2::Error> {
        match conn {
            // Named prepared statements live in one server session, which a transaction
            // pooler hands to other clients between transactions: without the cache diesel
            // sends each statement with its parameters in one message (PQsendQueryParams),
            // which any server session can run.
            #[cfg(feature = "postgres")]
            AnyConnection::Postgresql(c) if self.behind_pooler => {
                c.set_prepared_statement_cache_size(diesel::connection::CacheSize::Disabled);
                Ok(())
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
        }
    }
}

/// The query parameter of a PostgreSQL URL that says the connections go through a
/// transaction-pooling PgBouncer (or a pooler like it): `dlock_pooler=transaction`.
pub(crate) const POOLER_PARAM: &str = "dlock_pooler";

/// Takes `dlock_pooler=transaction` out of a URL's query (libpq refuses parameters it does not
/// know): the URL without it, and whether it was there.
fn take_pooler_param(url: &str) -> Result<(String, bool)> {
    let Some((base, query)) = url.split_once('?') else {
        return Ok((url.to_owned(), false));
    };
    let mut pooled = false;
    let mut kept = Vec::new();
    for pair in query.split('&') {
        let name = pair.split_once('=').map_or(pair, |(name, _)| name);
        if name != POOLER_PARAM {
            kept.push(pair);
        } else if pair == "dlock_pooler=transaction" {
            pooled = true;
        } else {
            return Err(Error::InvalidUrl(
                "dlock_pooler takes one value: transaction (for session pooling, leave it out)"
                    .into(),
            ));
        }
    }
    if pooled && !(base.starts_with("postgres://") || base.starts_with("postgresql://")) {
        return Err(Error::InvalidUrl(
            "dlock_pooler is for PostgreSQL URLs (PgBouncer)".into(),
        ));
    }
    let url = match kept.join("&") {
        q if q.is_empty() => base.to_owned(),
        q => format!("{base}?{q}"),
    };
    Ok((url, pooled))
}

/// True if `url` says it goes through a transaction pooler (`dlock_pooler=transaction`).
pub(crate) fn behind_pooler(url: &str) -> bool {
    take_pooler_param(url.trim()).map_or(true, |(_, pooled)| pooled)
}

/// Turns a user's URL into the one diesel expects, refusing what cannot work.
fn normalize(url: &str) -> Result<String> {
    let url = url.trim();
    if url.is_empty() {
        return Err(Error::InvalidUrl("the url is empty".into()));
    }
    let Some((scheme, rest)) = url.split_once("://") else {
        return if cfg!(feature = "sqlite") {
            sqlite_path(url)
        } else {
            Err(Error::InvalidUrl(
                "a plain path means SQLite, which this build does not include".into(),
            ))
        };
    };
    match scheme {
        "postgres" | "postgresql" if cfg!(feature = "postgres") => Ok(url.to_owned()),
        "mysql" | "mariadb" if cfg!(feature = "mysql") => Ok(format!("mysql://{rest}")),
        "sqlite" if cfg!(feature = "sqlite") => sqlite_path(rest),
        "postgres" | "postgresql" | "mysql" | "mariadb" | "sqlite" => Err(Error::InvalidUrl(
            "this build of diesel-lock does not include that backend's feature".into(),
        )),
        _ => Err(Error::InvalidUrl(
            "unknown scheme: use postgres://, mysql://, sqlite:// or a file path".into(),
        )),
    }
}

fn sqlite_path(path: &str) -> Result<String> {
    if path.is_empty() {
        return Err(Error::InvalidUrl("the sqlite path is empty".into()));
    }
    if path == ":memory:" || path.contains("mode=memory") {
        // Each pooled connection would get its own private database: locks in it would
        // exclude nobody.
        return Err(Error::InvalidUrl(
            "an in-memory SQLite database cannot be shared between connections; use a file".into(),
        ));
    }
    Ok(path.to_owned())
}

/// Builds a connection pool for `url`: `postgres://…`, `mysql://…`, `sqlite://path` or a
/// plain file path (SQLite). One connection is opened first, so a wrong URL or an unreachable
/// server fails at once with the driver's reason (which never contains the password).
///
/// SQLite connections get [`SqliteTuning`](crate::SqliteTuning). A PostgreSQL URL with the
/// query parameter `dlock_pooler=transaction` goes through a transaction-pooling PgBouncer
/// (or a pooler like it): the parameter is taken out of the URL before libpq sees it, and
/// the pool's connections run without diesel's cache of named prepared statements, which
/// such a pooler breaks (docs/guide.md, "Behind a connection pooler": which strategies work there).
/// The pool holds at most 10
/// connections and waits at most 10 s for one. Its failures to connect (a database
/// restarting, say) are logged at `warn` at most once per 10 s, the rest at `debug`.
///
/// ```
/// # fn main() -> diesel_lock::Result<()> {
/// # let dir = tempfile::tempdir().unwrap();
/// # let path = dir.path().join("locks.db");
/// let pool = diesel_lock::connect(path.to_str().unwrap())?;
/// let locker = diesel_lock::Locker::builder(pool).build()?;
/// locker.migrate()?;
/// # Ok(()) }
/// ```
///
/// # Errors
/// [`Error::InvalidUrl`] for an empty URL, an unknown scheme, a backend this build lacks, or an
/// in-memory SQLite database; [`Error::Connection`] if the first connection fails;
/// [`Error::Pool`] if the pool cannot be built.
pub fn connect(url: &str) -> Result<Pool<ConnectionManager<AnyConnection>>> {
    let (url, behind_pooler) = take_pooler_param(&normalize(url)?)?;
    #[cfg(feature = "postgres")]
    let url = if url.starts_with("postgres") && !behind_pooler {
        listen_urls::remember(url)
    } else {
        url
    };
    // diesel's MultiConnection::establish tries every backend in turn and keeps none of their
    // errors; the backend the URL names is asked directly, so a failure says why.
    #[cfg(feature = "postgres")]
    if url.starts_with("postgres") {
        drop(diesel::PgConnection::establish(&url)?);
    }
    #[cfg(feature = "mysql")]
    if url.starts_with("mysql://") {
        drop(diesel::MysqlConnection::establish(&url)?);
    }
    #[cfg(feature = "sqlite")]
    if !url.contains("://") {
        drop(diesel::SqliteConnection::establish(&url)?);
    }
    Pool::builder()
        .max_size(10)
        // No idle minimum: r2d2 refills idle connections on a background thread, and a refill
        // still connecting when a short-lived program exits can crash in libpq's TLS code.
        .min_idle(Some(0))
        .connection_timeout(Duration::from_secs(10))
        .connection_customizer(Box::new(AnyTuning { behind_pooler }))
        .error_handler(Box::new(QuietErrors::default()))
        .build(ConnectionManager::new(url))
        .map_err(Error::Pool)
}

/// The pool's connection errors, at `warn` at most once per 10 s and at `debug` in between:
/// r2d2's default handler logs every failed attempt at `error`, a line every few hundred
/// milliseconds per pool while a database restarts. Callers hear of an outage from the calls that fail, and waits log it once.
#[derive(Debug, Default)]
struct QuietErrors {
    last_warned: std::sync::Mutex<Option<std::time::Instant>>,
}

impl QuietErrors {
    /// True for the first error in 10 s (which then starts the next 10 s).
    fn time_to_warn(&self) -> bool {
        let mut last = self.last_warned.lock().unpoisoned();
        if last.is_some_and(|t| t.elapsed() < Duration::from_secs(10)) {
            return false;
        }
        *last = Some(std::time::Instant::now());
        true
    }
}

impl r2d2::HandleError<diesel::r2d2::Error> for QuietErrors {
    fn handle_error(&self, e: diesel::r2d2::Error) {
        if self.time_to_warn() {
            log::warn!("database connection failed: {e} (repeats within 10 s are logged at debug)");
        } else {
            log::debug!("database connection failed: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A storm of connection errors makes one warning, not one per error.
    #[test]
    fn connection_errors_warn_once_per_interval() {
        let quiet = QuietErrors::default();
        let warned: Vec<bool> = (0..5).map(|_| quiet.time_to_warn()).collect();
        assert_eq!(warned, [true, false, false, false, false]);
        // Ten seconds on, the next one warns again.
        *quiet.last_warned.lock().unwrap() =
            std::time::Instant::now().checked_sub(Duration::from_secs(11));
        assert!(quiet.time_to_warn());
    }

    #[test]
    fn urls() {
        assert!(matches!(normalize(""), Err(Error::InvalidUrl(_))));
        assert!(matches!(normalize("redis://x"), Err(Error::InvalidUrl(_))));
        #[cfg(feature = "sqlite")]
        {
            assert_eq!(normalize("sqlite://dlock.db").unwrap(), "dlock.db");
            assert_eq!(normalize("/tmp/x.db").unwrap(), "/tmp/x.db");
            assert!(matches!(normalize(":memory:"), Err(Error::InvalidUrl(_))));
        }
        #[cfg(feature = "mysql")]
        assert_eq!(normalize("mariadb://u@h/d").unwrap(), "mysql://u@h/d");
    }

    #[test]
    fn the_pooler_parameter_is_taken_out() {
        let t = |u: &str| take_pooler_param(u).map_err(|e| e.to_string());
        assert_eq!(t("postgres://h/d"), Ok(("postgres://h/d".into(), false)));
        assert_eq!(
            t("postgres://h/d?dlock_pooler=transaction"),
            Ok(("postgres://h/d".into(), true))
        );
        assert_eq!(
            t("postgresql://h/d?sslmode=disable&dlock_pooler=transaction&application_name=x"),
            Ok((
                "postgresql://h/d?sslmode=disable&application_name=x".into(),
                true
            ))
        );
        assert_eq!(
            t("postgres://h/d?sslmode=disable"),
            Ok(("postgres://h/d?sslmode=disable".into(), false))
        );
        assert!(t("postgres://h/d?dlock_pooler=session").is_err());
        assert!(t("postgres://h/d?dlock_pooler").is_err());
        assert!(t("mysql://h/d?dlock_pooler=transaction").is_err());
        assert!(behind_pooler("postgres://h/d?dlock_pooler=transaction"));
        assert!(!behind_pooler("postgres://h/d"));
    }
}

/// The URLs of the PostgreSQL pools `connect` built, so that a `Locker` over one of them
/// can open its own listening connection (`pg/listen.rs`) without being told the URL: a
/// pool does not say which URL it connects to. Each pool's URL gets
/// `fallback_application_name=diesel-lock-N` (libpq uses it only where neither the URL nor
/// `PGAPPNAME` names an application), and `LockerBuilder::build` asks a connection its
/// `application_name` and looks N up here. A pool whose connections carry another name
/// gets no listener unless given `listen_url`; its waiters poll.
#[cfg(feature = "postgres")]
pub(crate) mod listen_urls {
    use crate::sync::Unpoison;
    use std::sync::Mutex;

    const PREFIX: &str = "diesel-lock-";

    static URLS: Mutex<Vec<String>> = Mutex::new(Vec::new());

    /// Records `url` and returns it with its number as fallback application name.
    pub(super) fn remember(url: String) -> String {
        if url.contains("fallback_application_name=") {
            return url;
        }
        let mut urls = URLS.lock().unpoisoned();
        let n = match urls.iter().position(|u| *u == url) {
            Some(n) => n,
            None => {
                urls.push(url.clone());
                urls.len() - 1
            }
        };
        let sep = if url.contains('?') { '&' } else { '?' };
        format!("{url}{sep}fallback_application_name={PREFIX}{n}")
    }

    /// The URL of the pool whose connections carry `application_name`, if `connect` built it.
    pub(crate) fn of(application_name: &str) -> Option<String> {
        let n: usize = application_name.strip_prefix(PREFIX)?.parse().ok()?;
        URLS.lock().unpoisoned().get(n).cloned()
    }
}
