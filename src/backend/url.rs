//! Database URLs: which backend a URL names (decided by its scheme, never by a prefix), the
//! parameters of ours that diesel and the drivers must not see (`dlock_pooler`,
//! `dlock_pool_size`), and the secrets of a URL, found whatever its shape, which no message
//! of the library may contain.

use super::Backend;
use crate::{Error, Result};

/// The query parameter of a PostgreSQL URL that says the connections go through a
/// transaction-pooling PgBouncer (or a pooler like it): `dlock_pooler=transaction`.
pub(crate) const POOLER_PARAM: &str = "dlock_pooler";

/// The query parameter that sizes the pool the library builds from a URL.
pub(crate) const POOL_SIZE_PARAM: &str = "dlock_pool_size";

/// The size of a pool the library builds when neither the URL nor the builder says.
pub(crate) const DEFAULT_POOL_SIZE: u32 = 10;

/// A URL understood: what diesel is given, the backend it names, and our own parameters.
#[derive(Clone)]
pub(crate) struct Target {
    /// The URL for diesel: our parameters taken out, `mariadb://` written `mysql://`, a
    /// SQLite URL reduced to its path.
    pub(crate) url: String,
    pub(crate) backend: Backend,
    /// `dlock_pooler=transaction`.
    pub(crate) behind_pooler: bool,
    /// `dlock_pool_size=N`.
    pub(crate) pool_size: Option<u32>,
    /// What must never be printed: the password, however the URL was written.
    pub(crate) secrets: Secrets,
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target")
            .field("url", &self.secrets.scrub(&self.url))
            .field("backend", &self.backend)
            .finish_non_exhaustive()
    }
}

/// Reads a user's URL: `postgres://` or `postgresql://`, `mysql://` or `mariadb://`,
/// `sqlite://PATH`, or a plain file path (SQLite). Errors never quote the URL.
pub(crate) fn parse(url: &str) -> Result<Target> {
    let url = url.trim();
    let secrets = Secrets::of(url);
    if url.is_empty() {
        return Err(Error::InvalidUrl("the url is empty".into()));
    }
    let (backend, rest) = match url.split_once("://") {
        Some((scheme, rest)) => (scheme_backend(scheme)?, Some(rest)),
        None => {
            refuse_url_shapes(url)?;
            (Backend::Sqlite, None)
        }
    };
    if !backend_compiled(backend) {
        return Err(Error::InvalidUrl(format!(
            "this build of diesel-lock does not include {}: enable the Cargo feature `{}`",
            backend.name(),
            feature_of(backend)
        )));
    }
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (url, None),
    };
    let mut behind_pooler = false;
    let mut pool_size = None;
    let mut kept = Vec::new();
    for pair in query.into_iter().flat_map(|q| q.split('&')) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        match name {
            POOLER_PARAM if value == "transaction" => behind_pooler = true,
            POOLER_PARAM => {
                return Err(Error::InvalidUrl(
                    "dlock_pooler takes one value: transaction (for session pooling, leave it out)"
                        .into(),
                ))
            }
            POOL_SIZE_PARAM => match value.parse::<u32>() {
                Ok(n) if n >= 1 => pool_size = Some(n),
                _ => {
                    return Err(Error::InvalidUrl(
                        "dlock_pool_size takes a number of connections, 1 or more".into(),
                    ))
                }
            },
            _ => kept.push(pair),
        }
    }
    if behind_pooler && backend != Backend::Postgres {
        return Err(Error::InvalidUrl(
            "dlock_pooler is for PostgreSQL URLs (PgBouncer)".into(),
        ));
    }
    let base = match (backend, rest) {
        (Backend::Mysql, Some(_)) => {
            format!("mysql://{}", base.split_once("://").unwrap_or(("", base)).1)
        }
        (Backend::Sqlite, Some(_)) => base.split_once("://").unwrap_or(("", base)).1.to_owned(),
        // libpq knows its schemes in lowercase only.
        (Backend::Postgres, Some(_)) => match base.split_once("://") {
            Some((scheme, rest)) => format!("{}://{rest}", scheme.to_ascii_lowercase()),
            None => base.to_owned(),
        },
        _ => base.to_owned(),
    };
    let url = match kept.join("&") {
        q if q.is_empty() => base,
        q => format!("{base}?{q}"),
    };
    if backend == Backend::Sqlite {
        sqlite_path(&url)?;
    }
    Ok(Target {
        url,
        backend,
        behind_pooler,
        pool_size,
        secrets,
    })
}

/// The backend of a URL's scheme (the part before `://`).
fn scheme_backend(scheme: &str) -> Result<Backend> {
    match scheme.to_ascii_lowercase().as_str() {
        "postgres" | "postgresql" => Ok(Backend::Postgres),
        "mysql" | "mariadb" => Ok(Backend::Mysql),
        "sqlite" => Ok(Backend::Sqlite),
        s if s.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
            && s.chars().all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c)) =>
        {
            Err(Error::InvalidUrl(format!(
                "unknown scheme {s:?}: use postgres://, mysql://, sqlite:// or a file path"
            )))
        }
        // Not a scheme at all (`user:password@host://…`): not quoted, it may hold a secret.
        _ => Err(Error::InvalidUrl(
            "malformed url: it must start with postgres://, mysql:// or sqlite://, or be a file path"
                .into(),
        )),
    }
}

/// Refuses what is meant as a server URL but lacks `://`, rather than opening a SQLite file
/// of that name: `postgres:/…`, `mysql:…`, and `user:password@host/…` without a scheme.
fn refuse_url_shapes(url: &str) -> Result<()> {
    let lower = url.to_ascii_lowercase();
    for scheme in ["postgresql", "postgres", "mysql", "mariadb", "sqlite"] {
        if lower
            .strip_prefix(scheme)
            .is_some_and(|r| r.starts_with(':'))
        {
            return Err(Error::InvalidUrl(format!(
                "malformed url: a {scheme} url starts with {scheme}://"
            )));
        }
    }
    if url.contains('@') && url.contains(':') {
        return Err(Error::InvalidUrl(
            "malformed url: user@host needs a scheme in front (postgres:// or mysql://); a file path has no ':' and '@'"
                .into(),
        ));
    }
    Ok(())
}

fn sqlite_path(path: &str) -> Result<()> {
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
    Ok(())
}

/// Whether this build has `backend`'s feature.
pub(crate) fn backend_compiled(backend: Backend) -> bool {
    match backend {
        Backend::Postgres => cfg!(feature = "postgres"),
        Backend::Mysql => cfg!(feature = "mysql"),
        Backend::Sqlite => cfg!(feature = "sqlite"),
    }
}

/// The Cargo feature that compiles `backend` in.
pub(crate) fn feature_of(backend: Backend) -> &'static str {
    match backend {
        Backend::Postgres => "postgres",
        Backend::Mysql => "mysql",
        Backend::Sqlite => "sqlite",
    }
}

/// True if `url` says it goes through a transaction pooler (`dlock_pooler=transaction`); a
/// URL that cannot be read counts as one (it is refused elsewhere).
pub(crate) fn behind_pooler(url: &str) -> bool {
    parse(url).map_or(true, |t| t.behind_pooler)
}

/// The secrets of a URL: its password (as written and %-decoded) and `password=` values,
/// found in well-formed URLs and in mistyped ones alike (one slash, no scheme, a password
/// holding `@` or `/`), and the pieces a driver might quote of a password it cut apart.
#[derive(Clone, Default)]
pub(crate) struct Secrets(Vec<String>);

impl Secrets {
    pub(crate) fn of(url: &str) -> Self {
        let mut found = Vec::new();
        // The user part: after the scheme's "//" or ":" (or from the start), up to the LAST
        // '@' before any '?' (a password may hold '@' and '/'), then after its first ':'.
        if let Some(password) = password_of(url) {
            found.push(password.to_owned());
        }
        // A password that holds a raw '?' hides from the reading above, which cuts the URL
        // at its first '?': read once more up to the last '@' of the whole URL.
        if let Some(password) = password_of_uncut(url) {
            if password.contains('?') {
                found.push(password.to_owned());
            }
        }
        if let Some((_, query)) = url.split_once('?') {
            for pair in query.split('&') {
                if let Some((k, v)) = pair.split_once('=') {
                    if k.eq_ignore_ascii_case("password") {
                        found.push(v.to_owned());
                    }
                }
            }
        }
        let mut secrets = Vec::new();
        for s in found {
            secrets.push(percent_decode(&s));
            // A driver that split the password at '@', '/' or ':' may quote a piece of it.
            secrets.extend(s.split(['@', '/', ':']).map(str::to_owned));
            secrets.push(s);
        }
        // Very short strings would blank out ordinary words; such passwords (or pieces) are
        // not looked for.
        secrets.retain(|s| s.len() >= 4);
        // The longest first, so that a piece does not leave the rest of its password behind.
        secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
        secrets.dedup();
        Secrets(secrets)
    }

    /// `text` with every secret masked as `***`.
    pub(crate) fn scrub(&self, text: &str) -> String {
        let mut text = text.to_owned();
        for s in &self.0 {
            text = text.replace(s.as_str(), "***");
        }
        text
    }

    /// A connection error with the secrets masked in its message.
    pub(crate) fn scrub_connection(&self, e: diesel::ConnectionError) -> diesel::ConnectionError {
        use diesel::ConnectionError as E;
        match e {
            E::BadConnection(m) => E::BadConnection(self.scrub(&m)),
            E::InvalidConnectionUrl(m) => E::InvalidConnectionUrl(self.scrub(&m)),
            E::CouldntSetupConfiguration(e) => E::BadConnection(self.scrub(&e.to_string())),
            other => E::BadConnection(self.scrub(&other.to_string())),
        }
    }
}

/// `text` with every secret of `url` masked as `***`: its password (as written and
/// %-decoded, in a well-formed URL or a mistyped one: one slash, no scheme, a password
/// holding `@` or `/`) and `password=` values, and the pieces a driver that cut the password
/// apart may quote. Secrets shorter than 4 bytes are not looked for (they would blank out
/// ordinary words). Every message of the library is masked this way; this is for an
/// application's own messages about the same URL.
///
/// ```
/// let url = "postgres:/dlock:S3CRETPW@127.0.0.1:5432/locks"; // one slash: mistyped
/// let said = format!("could not connect to {url}");
/// assert_eq!(
///     diesel_lock::mask_secrets(url, &said),
///     "could not connect to postgres:/dlock:***@127.0.0.1:5432/locks"
/// );
/// ```
pub fn mask_secrets(url: &str, text: &str) -> String {
    Secrets::of(url).scrub(text)
}

/// The password of a URL of any shape: the user part runs from after the scheme (`x://`, or
/// `x:` when a `user:password` follows it, as in `postgres:/u:pw@h`; else from the start, as
/// in `u:pw@h`) to the LAST `@` before any `?` (a password may hold `@` and `/`); the
/// password is what follows its first `:`.
fn password_of(url: &str) -> Option<&str> {
    let head = url.split_once('?').map_or(url, |(h, _)| h);
    fn user_part(from: &str) -> Option<&str> {
        from.rsplit_once('@').map(|(u, _)| u)
    }
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

/// The password as `password_of` reads it, but from the user part up to the last `@` of
/// the whole URL (a password may hold a raw `?`).
fn password_of_uncut(url: &str) -> Option<&str> {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let user = rest.rsplit_once('@')?.0;
    user.split_once(':').map(|(_, password)| password)
}

/// `s` with its %-escapes decoded (a URL's password may be written either way).
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (bytes[i], bytes.get(i + 1), bytes.get(i + 2)) {
            (b'%', Some(&h), Some(&l)) if hex(h).is_some() && hex(l).is_some() => {
                out.push((hex(h).unwrap_or(0) * 16 + hex(l).unwrap_or(0)) as u8);
                i += 3;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_password_with_a_raw_question_mark_is_masked() {
        for url in [
            "postgres://dlock:dl?ock1@127.0.0.1:1/x",
            "mysql://dlock:my?pass9@127.0.0.1:3306/db?x=1",
        ] {
            let pw = if url.starts_with("postgres") {
                "dl?ock1"
            } else {
                "my?pass9"
            };
            let said = super::mask_secrets(url, &format!("at {url}: refused"));
            assert!(!said.contains(pw), "{said}");
        }
    }

    #[test]
    fn an_upper_case_postgres_scheme_reaches_the_driver_in_lower_case() {
        let t = super::parse("POSTGRES://u:secretpw@127.0.0.1:5432/db");
        if let Ok(t) = t {
            assert!(t.url.starts_with("postgres://"), "{}", t.url);
        }
    }

    use super::*;

    fn invalid(url: &str) -> String {
        match parse(url) {
            Err(Error::InvalidUrl(why)) => why,
            other => panic!("{url:?}: {other:?}"),
        }
    }

    #[test]
    fn the_scheme_decides_the_backend() {
        for url in [
            "",
            "  ",
            "redis://x",
            "sqlite://",
            ":memory:",
            "sqlite://:memory:",
        ] {
            invalid(url);
        }
        // A file whose name begins with "postgres" is a SQLite file, not a libpq string.
        #[cfg(feature = "sqlite")]
        {
            let t = parse("postgres-locks.db").unwrap();
            assert_eq!(
                (t.backend, t.url.as_str()),
                (Backend::Sqlite, "postgres-locks.db")
            );
            assert_eq!(parse("sqlite://dlock.db").unwrap().url, "dlock.db");
            assert_eq!(parse("/tmp/x.db").unwrap().url, "/tmp/x.db");
        }
        #[cfg(feature = "mysql")]
        assert_eq!(parse("mariadb://u@h/d").unwrap().url, "mysql://u@h/d");
        #[cfg(feature = "postgres")]
        assert_eq!(
            parse("postgresql://u@h/d").unwrap().backend,
            Backend::Postgres
        );
        // Meant as server URLs, mistyped: refused, and the message quotes none of it.
        for url in [
            "postgres:/dlock:S3CRETPW@127.0.0.1:5432/usab",
            "postgres:dlock:S3CRETPW@127.0.0.1/usab",
            "mysql:/dlock:S3CRETPW@127.0.0.1:3306/usab",
            "dlock:S3CRETPW@127.0.0.1:5432/usab",
            "dlock:S3CRETPW@127.0.0.1://x",
        ] {
            let why = invalid(url);
            assert!(why.contains("malformed"), "{url}: {why}");
            assert!(!why.contains("S3CRETPW"), "{why}");
        }
        assert!(invalid("redis://x").contains("\"redis\""));
    }

    #[test]
    fn a_missing_feature_is_named() {
        for (url, feature) in [
            ("postgres://h/d", "postgres"),
            ("mysql://h/d", "mysql"),
            ("x.db", "sqlite"),
        ] {
            match parse(url) {
                Ok(t) => assert!(backend_compiled(t.backend)),
                Err(e) => {
                    let why = e.to_string();
                    assert!(why.contains(&format!("`{feature}`")), "{why}");
                }
            }
        }
    }

    #[test]
    fn our_parameters_are_taken_out() {
        if !cfg!(feature = "postgres") {
            return;
        }
        let t = |u: &str| {
            parse(u)
                .map(|t| (t.url, t.behind_pooler, t.pool_size))
                .map_err(|e| e.to_string())
        };
        assert_eq!(
            t("postgres://h/d"),
            Ok(("postgres://h/d".into(), false, None))
        );
        assert_eq!(
            t("postgres://h/d?dlock_pooler=transaction"),
            Ok(("postgres://h/d".into(), true, None))
        );
        assert_eq!(
            t("postgresql://h/d?sslmode=disable&dlock_pooler=transaction&dlock_pool_size=3&application_name=x"),
            Ok((
                "postgresql://h/d?sslmode=disable&application_name=x".into(),
                true,
                Some(3)
            ))
        );
        assert!(t("postgres://h/d?dlock_pooler=session").is_err());
        assert!(t("postgres://h/d?dlock_pooler").is_err());
        assert!(t("postgres://h/d?dlock_pool_size=0").is_err());
        assert!(t("postgres://h/d?dlock_pool_size=many").is_err());
        assert!(behind_pooler("postgres://h/d?dlock_pooler=transaction"));
        assert!(!behind_pooler("postgres://h/d"));
        if cfg!(feature = "mysql") {
            assert!(t("mysql://h/d?dlock_pooler=transaction").is_err());
        }
    }

    #[test]
    fn secrets_are_found_whatever_the_shape() {
        for (url, secret) in [
            ("postgres://dlock:S3CRETPW@127.0.0.1:5432/usab", "S3CRETPW"),
            ("postgres:/dlock:S3CRETPW@127.0.0.1:5432/usab", "S3CRETPW"),
            ("mysql:/dlock:S3CRETPW@127.0.0.1/usab", "S3CRETPW"),
            ("dlock:S3CRETPW@127.0.0.1:5432/usab", "S3CRETPW"),
            ("dlock:S3CRETPW@127.0.0.1://usab", "S3CRETPW"),
            ("postgres://dlock:S3%43RETPW@h/d", "S3CRETPW"),
            ("postgres://dlock:S3%43RETPW@h/d", "S3%43RETPW"),
            ("postgres://dlock:p@ss@word@h/d", "p@ss@word"),
            ("postgres://dlock:pass/word1@h/d", "pass/word1"),
            ("postgres://dlock:pass/word1@h/d", "word1"),
            ("postgres://h/d?user=dlock&password=S3CRETPW", "S3CRETPW"),
        ] {
            let s = Secrets::of(url);
            let text = format!("failed for {url} and {secret}");
            let scrubbed = s.scrub(&text);
            assert!(!scrubbed.contains(secret), "{url}: {scrubbed}");
        }
        // A short password is not looked for: it would blank out ordinary words.
        assert_eq!(Secrets::of("postgres://u:pw@h/d").scrub("pw"), "pw");
    }
}
