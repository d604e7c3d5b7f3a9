//! The database URL: its passwords found once and masked in every message (`redacted`,
//! `scrub`), and the connection pool, with a connection failure reported without secrets.

use crate::args::{one_line, Failure, EXIT_RUNTIME};
use diesel::r2d2::{ConnectionManager, Pool};
use diesel_lock::AnyConnection;

/// The database URL as given, and its secrets, which no message may contain.
#[derive(Debug)]
pub(crate) struct Database {
    pub(crate) url: String,
    secrets: Vec<String>,
}

impl Database {
    pub(crate) fn new(url: String) -> Self {
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
        // Very short strings would blank out ordinary words; such passwords are not looked
        // for (and no message is built from the URL unredacted in the first place).
        secrets.retain(|s| s.len() >= 4);
        Database { url, secrets }
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

    pub(crate) fn connect(&self) -> Result<Pool<ConnectionManager<AnyConnection>>, Failure> {
        log::info!("database: {}", self.redacted());
        diesel_lock::connect(&self.url).map_err(|e| {
            // connect() reports the driver's own reason as the error's source.
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
        })
    }
}

/// `s` with its %-escapes decoded (a URL's password may be written either way).
fn percent_decode(s: &str) -> String {
    url::form_urlencoded::parse(format!("x={s}").as_bytes())
        .next()
        .map_or_else(|| s.to_owned(), |(_, v)| v.into_owned())
}
