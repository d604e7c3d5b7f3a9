//! PostgreSQL sessions whose default isolation is not READ COMMITTED. At REPEATABLE READ the
//! line's statements of `Row` and `Lease` meet serialization failures, and newcomers took
//! keys past earlier waiters meanwhile (an adversary, 28 Nov: 1,418 passes in 50 s); at
//! SERIALIZABLE a `ForUpdate` holder's `check()` was aborted and `lock()` failed. So: a
//! `Locker` built from a URL (`Locker::connect`) runs the sessions it opens directly at READ
//! COMMITTED whatever the database's default, and a pool whose sessions run at SERIALIZABLE
//! (the caller's own, or one through a transaction pooler, where no session setting can be
//! made) is refused at `build`.
#![cfg(feature = "postgres")]

mod common;

use diesel::connection::SimpleConnection;
use diesel::r2d2::{ConnectionManager, CustomizeConnection, Pool};
use diesel::{Connection, PgConnection, QueryableByName, RunQueryDsl};
use diesel_lock::{Error, Locker, Strategy};
use std::time::Duration;

#[derive(QueryableByName)]
struct Level {
    #[diesel(sql_type = diesel::sql_types::Text)]
    level: String,
}

fn level<C>(c: &mut C) -> String
where
    C: Connection,
    diesel::query_builder::SqlQuery: diesel::query_dsl::LoadQuery<'static, C, Level>,
{
    diesel::sql_query("SELECT current_setting('transaction_isolation') AS level")
        .get_result::<Level>(c)
        .unwrap()
        .level
}

fn strategies() -> [Strategy; 5] {
    [
        Strategy::Row { stale_after: None },
        Strategy::Lease {
            ttl: Duration::from_secs(10),
        },
        Strategy::ForUpdate,
        Strategy::Advisory,
        Strategy::AdvisoryXact,
    ]
}

/// `url` with `default_transaction_isolation` set for its sessions (libpq's `options`).
fn at(url: &str, level: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!(
        "{url}{sep}options=-c%20default_transaction_isolation%3D{}",
        level.replace(' ', "%5C%20")
    )
}

#[derive(Debug)]
struct SessionsAt(&'static str);

impl CustomizeConnection<PgConnection, diesel::r2d2::Error> for SessionsAt {
    fn on_acquire(&self, c: &mut PgConnection) -> Result<(), diesel::r2d2::Error> {
        c.batch_execute(&format!(
            "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL {}",
            self.0
        ))
        .map_err(diesel::r2d2::Error::QueryError)
    }
}

/// A pool of the caller's own whose sessions run at SERIALIZABLE is refused for every
/// strategy, with what to do about it; at REPEATABLE READ it builds (exclusion and tokens
/// hold there; `Row` and `Lease` log a warning about the line's order) and locks.
#[test]
fn a_pool_of_your_own_at_serializable_is_refused() {
    let Some(h) = common::pg_sized(1) else {
        return;
    };
    let make = |level| {
        Pool::builder()
            .max_size(2)
            .min_idle(Some(0))
            .connection_customizer(Box::new(SessionsAt(level)))
            .build(ConnectionManager::<PgConnection>::new(&h.url))
            .unwrap()
    };
    let serializable = make("SERIALIZABLE");
    assert_eq!(level(&mut *serializable.get().unwrap()), "serializable");
    for s in strategies() {
        match Locker::builder(serializable.clone()).strategy(s).build() {
            Err(Error::InvalidConfig(why)) => {
                assert!(why.contains("SERIALIZABLE"), "{s:?}: {why}");
                assert!(why.contains("read committed"), "{s:?}: {why}");
            }
            other => panic!("{s:?}: {other:?}"),
        }
    }
    let repeatable = make("REPEATABLE READ");
    for s in strategies() {
        let locker = Locker::builder(repeatable.clone())
            .strategy(s)
            .build()
            .unwrap_or_else(|e| panic!("{s:?}: {e}"));
        locker.migrate().unwrap();
        let key = common::unique_key("isolation-rr");
        let g = locker.lock(&key).unwrap();
        assert!(locker.try_lock(&key).unwrap().is_none(), "{s:?}");
        g.release().unwrap();
    }
}

/// `Locker::connect` runs every session it opens directly at READ COMMITTED, whatever the
/// sessions' default (here set in the URL, as a role's or a database's default would be):
/// the line keeps its order and `ForUpdate` its holders' checks.
#[test]
fn connect_runs_its_sessions_at_read_committed() {
    let Some(h) = common::pg_sized(1) else {
        return;
    };
    for default in ["serializable", "repeatable read"] {
        let url = at(&h.url, default);
        // The URL does set the sessions' default: a connection of its own says so.
        assert_eq!(level(&mut PgConnection::establish(&url).unwrap()), default);
        for s in strategies() {
            let locker = Locker::connect(&url)
                .unwrap()
                .strategy(s)
                .pool_size(3)
                .build()
                .unwrap_or_else(|e| panic!("{default}, {s:?}: {e}"));
            locker.migrate().unwrap();
            // Every connection of the pool, not just the first one opened.
            let held: Vec<_> = (0..3).map(|_| locker.pool().get().unwrap()).collect();
            for mut c in held {
                assert_eq!(level(&mut *c), "read committed", "{default}, {s:?}");
            }
            let key = common::unique_key("isolation-connect");
            let g = locker.lock(&key).unwrap();
            assert!(g.check().is_ok(), "{default}, {s:?}");
            g.release().unwrap();
        }
    }
}

/// Through a transaction pooler no session setting can be made (it would stay on a server
/// session that other clients get next): a database whose sessions run at SERIALIZABLE is
/// refused there, and `Locker::connect` says how to fix it.
#[test]
fn connect_through_a_pooler_to_a_serializable_database_is_refused() {
    let (Some(own), Some(bouncer)) = (common::pg_own_db_sized(1), common::pgbouncer_url()) else {
        return;
    };
    let name = common::database_name(&own.url).to_owned();
    PgConnection::establish(&own.url)
        .unwrap()
        .batch_execute(&format!(
            "ALTER DATABASE {name} SET default_transaction_isolation = 'serializable'"
        ))
        .unwrap();
    let url = common::with_database(&bouncer, &name);
    for s in [
        Strategy::Row { stale_after: None },
        Strategy::Lease {
            ttl: Duration::from_secs(10),
        },
        Strategy::ForUpdate,
        Strategy::AdvisoryXact,
    ] {
        match Locker::connect(&url).unwrap().strategy(s).build() {
            Err(Error::InvalidConfig(why)) => assert!(why.contains("SERIALIZABLE"), "{s:?}: {why}"),
            other => panic!("{s:?}: {other:?}"),
        }
    }
    // The CLI there: `list` reads as before (over a plain pool), `migrate` says why it
    // cannot (a usage error, exit 2).
    let dlock = |args: &[&str]| dlock(&url, None, args);
    let list = dlock(&["list"]);
    assert!(list.status.success(), "{list:?}");
    let migrate = dlock(&["migrate"]);
    assert_eq!(migrate.status.code(), Some(2), "{migrate:?}");
    assert!(
        String::from_utf8_lossy(&migrate.stderr).contains("SERIALIZABLE"),
        "{migrate:?}"
    );
}

/// The CLI's maintenance commands on a database whose sessions run at SERIALIZABLE or
/// REPEATABLE READ: `migrate` and `purge` were refused at SERIALIZABLE once `build` refused
/// such pools (helper-88: exit 2 where the build before exited 0), and `release --force` and
/// `purge` failed now and then with "could not serialize access" there. The CLI's pool is a
/// `Locker`'s own, at READ COMMITTED: every command succeeds, and `purge` warns of nothing.
#[test]
fn cli_maintenance_at_serializable_and_repeatable_read() {
    let Some(h) = common::pg_sized(1) else {
        return;
    };
    for default in ["serializable", "repeatable read"] {
        let url = at(&h.url, default);
        let key = common::unique_key("isolation-cli");
        let dlock = |args: &[&str]| {
            let out = dlock(&url, Some("warn"), args);
            let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
            assert!(
                out.status.success(),
                "{default}: dlock {args:?}: {:?}\n{stderr}",
                out.status
            );
            assert!(
                !stderr.contains("REPEATABLE READ"),
                "{default}: dlock {args:?}: {stderr}"
            );
        };
        dlock(&["migrate"]);
        dlock(&["run", "--key", &key, "--", "true"]);
        dlock(&["purge", "--older-than", "0s"]);
        dlock(&["release", "--force", &key]);
        dlock(&["list"]);
    }
}

/// `dlock ARGS` against `url`, its log filtered by `log` (none: no log).
fn dlock(url: &str, log: Option<&str>, args: &[&str]) -> std::process::Output {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_dlock"));
    cmd.args(args)
        .env("DLOCK_URL", url)
        .stdin(std::process::Stdio::null());
    match log {
        Some(filter) => cmd.env("RUST_LOG", filter),
        None => cmd.env_remove("RUST_LOG"),
    };
    cmd.output().unwrap()
}
