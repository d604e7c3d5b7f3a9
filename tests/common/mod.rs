//! Shared test setup: one harness per backend, unique keys, and the checks every backend ×
//! strategy must pass (`conformance`).
//!
//! PostgreSQL and MySQL come from `DLOCK_TEST_PG_URL` / `DLOCK_TEST_MYSQL_URL`. A missing URL
//! skips that backend with a printed line, unless `DLOCK_TEST_REQUIRE` is `all` (or names the
//! backend: `pg`, `mysql`), in which case it fails the test.
#![allow(dead_code, unreachable_pub)]

pub mod conformance;

use diesel::r2d2::{ConnectionManager, Pool};
use diesel_lock::{LockConnection, Locker, Strategy};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A pool on one backend, with whatever must live as long as it (a temp dir for SQLite).
pub struct Harness<C: LockConnection> {
    pub pool: Pool<ConnectionManager<C>>,
    pub url: String,
    /// Lockers made by this harness listen for releases on this URL (PostgreSQL).
    pub listen_url: Option<String>,
    _dir: Option<tempfile::TempDir>,
}

impl<C: LockConnection> Harness<C> {
    pub fn builder(&self, strategy: Strategy) -> diesel_lock::LockerBuilder<C> {
        let b = Locker::builder(self.pool.clone()).strategy(strategy);
        match &self.listen_url {
            Some(url) => b.listen_url(url.clone()),
            None => b,
        }
    }

    pub fn locker(&self, strategy: Strategy) -> Locker<C> {
        let locker = self.builder(strategy).build().expect("build");
        locker.migrate().expect("migrate");
        locker
    }
}

fn required(name: &str) -> bool {
    let req = std::env::var("DLOCK_TEST_REQUIRE").unwrap_or_default();
    req.split([',', ' ']).any(|r| r == "all" || r == name)
}

/// The URL for `var`, or `None` (skip) when it is unset and not required.
pub fn url(var: &str, name: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(u) if !u.is_empty() => Some(u),
        _ if required(name) => {
            panic!("{var} is not set but DLOCK_TEST_REQUIRE asks for {name}: eval \"$(bash scripts/services.sh)\"")
        }
        _ => {
            eprintln!("skipped: {var} is not set");
            None
        }
    }
}

/// No idle minimum: r2d2 refills idle connections from a background thread, and a refill still
/// connecting when the test process exits crashes inside OpenSSL's exit handlers (seen as
/// SIGSEGV in PQconnectdb → RAND_get_rand_method).
pub fn pool<C: LockConnection>(url: &str, size: u32) -> Pool<ConnectionManager<C>> {
    pool_builder(size)
        .build(ConnectionManager::<C>::new(url))
        .expect("pool")
}

/// The settings every test pool shares (see `pool` for why there is no idle minimum).
fn pool_builder<C: LockConnection>(size: u32) -> r2d2::Builder<ConnectionManager<C>> {
    Pool::builder()
        .max_size(size)
        .min_idle(Some(0))
        .connection_timeout(Duration::from_secs(10))
}

pub fn sqlite_sized(size: u32) -> Option<Harness<diesel::SqliteConnection>> {
    let dir = tempfile::tempdir().expect("tempdir");
    let url = dir.path().join("locks.db").to_str().unwrap().to_owned();
    let mut h = sqlite_at(&url, size);
    h._dir = Some(dir);
    Some(h)
}

/// A harness on an existing SQLite file (a child process joining its parent's database).
pub fn sqlite_at(path: &str, size: u32) -> Harness<diesel::SqliteConnection> {
    let pool = pool_builder(size)
        .connection_customizer(Box::new(diesel_lock::SqliteTuning::default()))
        .build(ConnectionManager::new(path))
        .expect("sqlite pool");
    Harness {
        pool,
        url: path.to_owned(),
        listen_url: None,
        _dir: None,
    }
}

/// A harness on a server URL.
pub fn server_at<C: LockConnection>(url: &str, size: u32) -> Harness<C> {
    Harness {
        pool: pool(url, size),
        url: url.to_owned(),
        listen_url: None,
        _dir: None,
    }
}

pub fn sqlite() -> Option<Harness<diesel::SqliteConnection>> {
    sqlite_sized(10)
}

#[cfg(feature = "postgres")]
pub fn pg_sized(size: u32) -> Option<Harness<diesel::PgConnection>> {
    let mut url = url("DLOCK_TEST_PG_URL", "pg")?;
    // Loopback needs no TLS, and a TLS handshake is where an exit-time race crashes (above).
    if !url.contains("sslmode") {
        url.push_str(if url.contains('?') {
            "&sslmode=disable"
        } else {
            "?sslmode=disable"
        });
    }
    Some(Harness {
        pool: pool(&url, size),
        url,
        listen_url: None,
        _dir: None,
    })
}

#[cfg(feature = "postgres")]
pub fn pg() -> Option<Harness<diesel::PgConnection>> {
    pg_sized(10)
}

/// PostgreSQL, with lockers that listen for releases.
#[cfg(feature = "postgres")]
pub fn pg_listening() -> Option<Harness<diesel::PgConnection>> {
    let mut h = pg_sized(10)?;
    h.listen_url = Some(h.url.clone());
    Some(h)
}

#[cfg(feature = "mysql")]
pub fn mysql_sized(size: u32) -> Option<Harness<diesel::MysqlConnection>> {
    let url = url("DLOCK_TEST_MYSQL_URL", "mysql")?;
    Some(server_at(&url, size))
}

#[cfg(feature = "mysql")]
pub fn mysql() -> Option<Harness<diesel::MysqlConnection>> {
    mysql_sized(10)
}

/// A key no other test (or earlier run against the same server) uses.
pub fn unique_key(name: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!(
        "{name}-{}-{nanos}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// Generates one `#[test]` per conformance check for a backend × strategy. A new check is one
/// more line in the list below (with its extra arguments, if any).
#[macro_export]
macro_rules! conformance_suite {
    ($module:ident, $harness:expr, $strategy:expr) => {
        $crate::conformance_suite!(@tests $module, $harness, $strategy,
            try_lock_on_held_key_is_none(),
            drop_and_release_both_free_the_key(),
            release_reports_a_lost_lock(),
            try_lock_for_returns_at_its_deadline(),
            waiter_gets_the_lock_when_it_is_released(),
            mutual_exclusion_across_threads(8, 200),
            tokens_strictly_increase(),
            keys_are_exact_and_any_text_works(),
            guard_reports_key_owner_and_db_time(),
            distinct_keys_do_not_block_each_other()
        );
    };
    (@tests $module:ident, $harness:expr, $strategy:expr, $($check:ident($($arg:expr),*)),+) => {
        mod $module {
            use super::common::conformance as c;
            #[allow(unused_imports)]
            use super::*;

            $(
                #[test]
                fn $check() {
                    if let Some(h) = $harness {
                        c::$check(&h, $strategy $(, $arg)*);
                    }
                }
            )+
        }
    };
}

/// MariaDB's `SIMULTANEOUS_ASSIGNMENT` sql_mode makes every `ON DUPLICATE KEY UPDATE`
/// assignment see the old row (MySQL's default is left to right); the lease SQL must be
/// right under both. `None` (skipped) on servers without that mode.
#[cfg(feature = "mysql")]
pub fn mysql_simultaneous_assignment() -> Option<Harness<diesel::MysqlConnection>> {
    use diesel::connection::SimpleConnection;
    use diesel::r2d2::CustomizeConnection;

    #[derive(Debug)]
    struct Mode;
    impl CustomizeConnection<diesel::MysqlConnection, diesel::r2d2::Error> for Mode {
        fn on_acquire(&self, c: &mut diesel::MysqlConnection) -> Result<(), diesel::r2d2::Error> {
            c.batch_execute("SET SESSION sql_mode = CONCAT(@@sql_mode, ',SIMULTANEOUS_ASSIGNMENT')")
                .map_err(diesel::r2d2::Error::QueryError)
        }
    }
    let url = url("DLOCK_TEST_MYSQL_URL", "mysql")?;
    // An unreachable server is a failure (as for every backend); only a server without the
    // mode (MySQL proper) skips.
    let mut probe =
        <diesel::MysqlConnection as diesel::Connection>::establish(&url).expect("connect");
    if Mode.on_acquire(&mut probe).is_err() {
        eprintln!("skipped: this server has no SIMULTANEOUS_ASSIGNMENT sql_mode (not MariaDB)");
        return None;
    }
    let pool = pool_builder(10)
        .connection_customizer(Box::new(Mode))
        .build(ConnectionManager::new(&url))
        .expect("pool");
    Some(Harness {
        pool,
        url,
        listen_url: None,
        _dir: None,
    })
}
