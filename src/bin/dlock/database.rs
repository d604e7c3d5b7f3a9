//! The database URL: its passwords found once, whatever the URL's shape, and masked in every
//! message (`redacted`, `scrub`); the default database, said on stderr when used; and the
//! connection pool, with a connection failure reported without secrets.

use crate::args::{one_line, Failure, EXIT_RUNTIME};
use diesel::r2d2::{ConnectionManager, Pool};
use diesel_lock::{AnyConnection, Error, Locker, LockerBuilder};

/// The database the CLI uses when neither `--url` nor `DLOCK_URL` names one.
pub(crate) const DEFAULT_URL: &str = "sqlite://dlock.db";

/// The database URL as given, and its secrets, which no message may contain.
#[derive(Debug)]
pub(crate) struct Database {
    pub(crate) url: String,
    /// No `--url` and no `DLOCK_URL`: the default, which is said on stderr when used.
    defaulted: bool,
}

impl Database {
    pub(crate) fn new(url: Option<String>) -> Self {
        let defaulted = url.is_none();
        let url = url.unwrap_or_else(|| DEFAULT_URL.to_owned());
        Database { url, defaulted }
    }

    /// The URL with its password (in the user part or a `password=` parameter) masked.
    fn redacted(&self) -> String {
        let Ok(mut parsed) = url::Url::parse(&self.url) else {
            return self.scrub(&self.url); // a plain path
        };
        if parsed.cannot_be_a_base() || parsed.scheme() == "sqlite" {
            return self.scrub(&self.url);
        }
        if parsed.password().is_some() {
            let _ = parsed.set_password(Some("***"));
        }
        if parsed
            .query_pairs()
            .any(|(k, _)| k.eq_ignore_ascii_case("password"))
        {
            let pairs: Vec<(String, String)> = parsed
                .query_pairs()
                .map(|(k, v)| {
                    let v = if k.eq_ignore_ascii_case("password") {
                        "***".to_owned()
                    } else {
                        v.into_owned()
                    };
                    (k.into_owned(), v)
                })
                .collect();
            parsed.query_pairs_mut().clear().extend_pairs(pairs);
        }
        self.scrub(parsed.as_str())
    }

    /// `text` with every secret of the URL masked.
    pub(crate) fn scrub(&self, text: &str) -> String {
        diesel_lock::mask_secrets(&self.url, text)
    }

    /// Says on stderr which database is used when no URL was given: a file in the current
    /// directory excludes only runs started in the same directory of the same machine (cron
    /// does not read the shell's `DLOCK_URL`). Once the database was opened: a usage error
    /// found first is the one line printed.
    pub(crate) fn say_default(&self) {
        if self.defaulted {
            let at = std::env::current_dir()
                .map(|d| d.join("dlock.db").display().to_string())
                .unwrap_or_else(|_| "dlock.db".to_owned());
            eprintln!(
                "dlock: warning: no --url and no DLOCK_URL: using the SQLite file {at}, which excludes only runs in this directory on this machine"
            );
        }
    }

    /// A pool for `list`, `status`, `release`, `migrate` and `purge`: a `Locker`'s own, as
    /// `Locker::connect` builds it, whose PostgreSQL sessions run at READ COMMITTED whatever
    /// the database's default isolation. A plain pool (`diesel_lock::connect`) at the
    /// database's default made `migrate` and `purge` refused on a database whose sessions
    /// run at SERIALIZABLE, and `release --force` and `purge` fail now and then there and at
    /// REPEATABLE READ ("could not serialize access"; helper-88). Where no `Locker` can be
    /// built (a database at SERIALIZABLE through a transaction pooler, where no session
    /// setting can be made), a plain pool: `list`, `status` and `release` read and delete
    /// there as before, and `migrate` and `purge` say why they cannot.
    pub(crate) fn connect(&self) -> Result<Pool<ConnectionManager<AnyConnection>>, Failure> {
        log::info!("database: {}", self.redacted());
        let pool = match Locker::connect(&self.url).and_then(|b| b.build()) {
            Ok(locker) => locker.pool().clone(),
            Err(Error::InvalidConfig(why)) => {
                log::debug!("a plain pool, as no Locker could be built: {why}");
                diesel_lock::connect(&self.url).map_err(|e| self.failure(e))?
            }
            Err(e) => return Err(self.failure(e)),
        };
        self.say_default();
        Ok(pool)
    }

    /// A `Locker` builder for `run`, over a pool of its own that keeps the URL (to listen on,
    /// and to say why a connection failed). The caller says the default once it is built.
    pub(crate) fn locker(&self) -> Result<LockerBuilder<AnyConnection>, Failure> {
        log::info!("database: {}", self.redacted());
        Locker::connect(&self.url).map_err(|e| self.failure(e))
    }

    /// A connection failure as one line naming the (masked) URL and the driver's reason.
    fn failure(&self, e: Error) -> Failure {
        // The library reports the driver's own reason as the error's source.
        let why = std::error::Error::source(&e).map(|s| one_line(&self.scrub(&s.to_string())));
        let mut f = Failure::from(e);
        if f.code == EXIT_RUNTIME {
            f.message = match why {
                Some(why) => format!(
                    "could not connect to the database at {}: {why}",
                    self.redacted()
                ),
                None => format!("{} ({})", f.message, self.redacted()),
            };
        }
        f
    }
}
