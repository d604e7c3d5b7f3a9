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
    secrets: Vec<String>,
}

impl Database {
    pub(crate) fn new(url: Option<String>) -> Self {
        let defaulted = url.is_none();
        let url = url.unwrap_or_else(|| DEFAULT_URL.to_owned());
        let mut secrets = Vec::new();
        if let Ok(parsed) = url::Url::parse(&url) {
            if let Some(p) = parsed.password() {
                secrets.push(p.to_owned());
                secrets.push(percent_decode(p));
            }
            for (k, v) in parsed.query_pairs() {
                if k.eq_ignore_ascii_case("password") {
                    secrets.push(v.into_owned());
                }
            }
        }
        secrets.extend(loose_secrets(&url));
        // Very short strings would blank out ordinary words; such passwords are not looked
        // for (and no message is built from the URL unredacted in the first place).
        secrets.retain(|s| s.len() >= 4);
        // The longest first, so that a piece of a password does not leave the rest behind.
        secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
        secrets.dedup();
        Database {
            url,
            defaulted,
            secrets,
        }
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
        let mut text = text.to_owned();
        for s in &self.secrets {
            text = text.replace(s.as_str(), "***");
        }
        text
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

    /// A pool for `list`, `status`, `release` and `migrate`.
    pub(crate) fn connect(&self) -> Result<Pool<ConnectionManager<AnyConnection>>, Failure> {
        log::info!("database: {}", self.redacted());
        let pool = diesel_lock::connect(&self.url).map_err(|e| self.failure(e))?;
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

/// The password of a URL of any shape, well-formed or mistyped (one slash, no scheme, a
/// password holding `@` or `/`), as written and %-decoded, and the pieces a driver that cut
/// it apart at `@`, `/` or `:` may quote.
fn loose_secrets(url: &str) -> Vec<String> {
    let Some(password) = password_of(url) else {
        return Vec::new();
    };
    let mut found = vec![password.to_owned(), percent_decode(password)];
    found.extend(password.split(['@', '/', ':']).map(str::to_owned));
    found
}

/// The user part runs from after the scheme (`x://`, or `x:` when a `user:password` follows
/// it, as in `postgres:/u:pw@h`; else from the start, as in `u:pw@h`) to the LAST `@` before
/// any `?`; the password is what follows its first `:`.
fn password_of(url: &str) -> Option<&str> {
    fn user_part(from: &str) -> Option<&str> {
        from.rsplit_once('@').map(|(u, _)| u)
    }
    let head = url.split_once('?').map_or(url, |(h, _)| h);
    let is_scheme = |s: &str| {
        s.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c))
    };
    let user = match head.split_once("://") {
        Some((scheme, rest)) if is_scheme(scheme) => user_part(rest)?,
        _ => {
            let whole = user_part(head)?;
            match whole.split_once(':') {
                Some((scheme, rest)) if rest.contains(':') && !scheme.contains('/') => {
                    rest.trim_start_matches('/')
                }
                _ => whole,
            }
        }
    };
    user.split_once(':').map(|(_, password)| password)
}

/// `s` with its %-escapes decoded (a URL's password may be written either way).
fn percent_decode(s: &str) -> String {
    url::form_urlencoded::parse(format!("x={s}").as_bytes())
        .next()
        .map_or_else(|| s.to_owned(), |(_, v)| v.into_owned())
}
