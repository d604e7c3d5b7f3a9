//! Shared test setup: one harness per backend, unique keys, and the checks every backend ×
//! strategy must pass (`conformance`).
//!
//! PostgreSQL and MySQL come from `DLOCK_TEST_PG_URL` / `DLOCK_TEST_MYSQL_URL`, PostgreSQL
//! through a transaction-pooling PgBouncer from `DLOCK_TEST_PGBOUNCER_URL`. A missing URL
//! skips that backend with a printed line, unless `DLOCK_TEST_REQUIRE` is `all` (or names the
//! backend: `pg`, `mysql`, `pgbouncer`), in which case it fails the test.
//!
//! `netns` (network-partition tests) skips the same way where the machine forbids network
//! namespaces, and fails instead when `DLOCK_TEST_REQUIRE` is `all` or names `netns`.
//!
//! `Locker::purge` is table-wide, so a test that purges on a server takes a database of its
//! own (`pg_own_db`, `mysql_own_db`): a purge beside other tests would delete their rows, and
//! theirs the rows it counts on.
#![allow(dead_code, unreachable_pub)]

pub mod conformance;
#[cfg(feature = "mysql")]
pub mod galera;
pub mod kids;
pub mod netns;
pub mod occupancy;
pub mod private_server;
#[cfg(feature = "mysql")]
pub mod replica_maria;
#[cfg(feature = "postgres")]
pub mod replica_pg;

use diesel::r2d2::{ConnectionManager, Pool};
use diesel_lock::{LockConnection, Locker, Strategy};
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A pool on one backend, with whatever must live as long as it (a temp dir for SQLite, a
/// database of its own on a server). Fields drop in order: the pool before the database.
pub struct Harness<C: LockConnection> {
    pub pool: Pool<ConnectionManager<C>>,
    pub url: String,
    /// Lockers made by this harness listen for releases on this URL (PostgreSQL).
    pub listen_url: Option<String>,
    _dir: Option<tempfile::TempDir>,
    _db: Option<OwnDb<C>>,
}

/// A database made for one test, dropped when this guard is (at the end of the test, or while
/// its panic unwinds), over a new connection to the test URL it was made from.
struct OwnDb<C: LockConnection> {
    name: String,
    admin_url: String,
    /// Run in order to drop it.
    drop_sql: Vec<String>,
    _backend: PhantomData<fn() -> C>,
}

impl<C: LockConnection> Drop for OwnDb<C> {
    fn drop(&mut self) {
        let dropped = C::establish(&self.admin_url)
            .map_err(|e| e.to_string())
            .and_then(|mut c| {
                self.drop_sql
                    .iter()
                    .try_for_each(|sql| c.batch_execute(sql))
                    .map_err(|e| e.to_string())
            });
        // Never panic here: this may run while a test's panic unwinds.
        if let Err(e) = dropped {
            eprintln!("could not drop the test database {}: {e}", self.name);
        }
    }
}

/// The database a server URL names (its path, without the query).
#[allow(dead_code)]
pub fn database_name(url: &str) -> &str {
    url.rsplit('/').next().unwrap().split('?').next().unwrap()
}

/// `url` with its database (the path) replaced by `name`, its query kept.
#[allow(dead_code)]
pub fn with_database(url: &str, name: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, format!("?{query}")),
        None => (url, String::new()),
    };
    let authority = base.find("://").map_or(0, |i| i + 3);
    let path = base[authority..]
        .find('/')
        .map_or(base.len(), |i| authority + i);
    format!("{}/{name}{query}", &base[..path])
}

/// A harness on a database made for it on the server at `url` (see `OwnDb`), `drop_sql`
/// making the statements that drop a database of that name.
fn own_db<C: LockConnection>(
    url: &str,
    size: u32,
    drop_sql: impl FnOnce(&str) -> Vec<String>,
) -> Harness<C> {
    own_db_via(url, drop_sql, |name| {
        server_at(&with_database(url, name), size)
    })
}

/// `own_db`, the harness on the new database (named `name`) made by `harness`: for a
/// database made on the server at `url` and reached through a pooler.
fn own_db_via<C: LockConnection>(
    url: &str,
    drop_sql: impl FnOnce(&str) -> Vec<String>,
    harness: impl FnOnce(&str) -> Harness<C>,
) -> Harness<C> {
    let name = unique_key("dlock_t").replace('-', "_");
    C::establish(url)
        .unwrap_or_else(|e| panic!("connect to {url}: {e}"))
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .unwrap_or_else(|e| panic!("create the test database {name}: {e}"));
    // From here on a panic drops the database too.
    let db = OwnDb {
        drop_sql: drop_sql(&name),
        name,
        admin_url: url.to_owned(),
        _backend: PhantomData,
    };
    let mut h = harness(&db.name);
    h._db = Some(db);
    h
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
///
/// A URL with `dlock_pooler=transaction` (a PgBouncer's) gives a pool as `diesel_lock::connect`
/// makes for it: the parameter taken out, no statement cache ([`NoStatementCache`]).
pub fn pool<C: LockConnection>(url: &str, size: u32) -> Pool<ConnectionManager<C>> {
    match strip_pooler(url) {
        Some(plain) => pool_builder(size)
            .connection_customizer(Box::new(NoStatementCache))
            .build(ConnectionManager::<C>::new(plain)),
        None => pool_builder(size).build(ConnectionManager::<C>::new(url)),
    }
    .expect("pool")
}

/// `url` without `dlock_pooler=transaction`, if it had it.
pub fn strip_pooler(url: &str) -> Option<String> {
    let (base, query) = url.split_once('?')?;
    let kept: Vec<&str> = query
        .split('&')
        .filter(|p| *p != "dlock_pooler=transaction")
        .collect();
    if kept.len() == query.split('&').count() {
        return None;
    }
    Some(if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", kept.join("&"))
    })
}

/// Makes a pool fit for a transaction pooler: no cache of named prepared statements (what
/// `connect` does for a `dlock_pooler=transaction` URL; docs/guide.md, "Behind a connection pooler").
#[derive(Debug, Clone, Copy)]
pub struct NoStatementCache;

impl<C: diesel::Connection> diesel::r2d2::CustomizeConnection<C, diesel::r2d2::Error>
    for NoStatementCache
{
    fn on_acquire(&self, c: &mut C) -> Result<(), diesel::r2d2::Error> {
        c.set_prepared_statement_cache_size(diesel::connection::CacheSize::Disabled);
        Ok(())
    }
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
        _db: None,
    }
}

/// A harness on a server URL.
pub fn server_at<C: LockConnection>(url: &str, size: u32) -> Harness<C> {
    Harness {
        pool: pool(url, size),
        url: url.to_owned(),
        listen_url: None,
        _dir: None,
        _db: None,
    }
}

pub fn sqlite() -> Option<Harness<diesel::SqliteConnection>> {
    sqlite_sized(10)
}

/// The PostgreSQL test URL, or `None` (skip; see `url`).
#[cfg(feature = "postgres")]
fn pg_url() -> Option<String> {
    let mut url = url("DLOCK_TEST_PG_URL", "pg")?;
    // Loopback needs no TLS, and a TLS handshake is where an exit-time race crashes (above).
    if !url.contains("sslmode") {
        url.push_str(if url.contains('?') {
            "&sslmode=disable"
        } else {
            "?sslmode=disable"
        });
    }
    Some(url)
}

#[cfg(feature = "postgres")]
pub fn pg_sized(size: u32) -> Option<Harness<diesel::PgConnection>> {
    Some(server_at(&pg_url()?, size))
}

#[cfg(feature = "postgres")]
pub fn pg() -> Option<Harness<diesel::PgConnection>> {
    pg_sized(10)
}

/// PostgreSQL, on a database of the test's own (for tests that purge).
#[cfg(feature = "postgres")]
pub fn pg_own_db_sized(size: u32) -> Option<Harness<diesel::PgConnection>> {
    Some(own_db(&pg_url()?, size, |name| {
        // FORCE (PostgreSQL 13+): ends whatever still connects to it, a leftover listener say.
        vec![format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")]
    }))
}

#[cfg(feature = "postgres")]
pub fn pg_own_db() -> Option<Harness<diesel::PgConnection>> {
    pg_own_db_sized(10)
}

/// PostgreSQL, with lockers that listen for releases.
#[cfg(feature = "postgres")]
pub fn pg_listening() -> Option<Harness<diesel::PgConnection>> {
    let mut h = pg_sized(10)?;
    h.listen_url = Some(h.url.clone());
    Some(h)
}

/// The PgBouncer URL as `scripts/services.sh` prints it (with `dlock_pooler=transaction`, for
/// `diesel_lock::connect`), or `None` (skip; see `url`).
#[cfg(feature = "postgres")]
pub fn pgbouncer_url() -> Option<String> {
    url("DLOCK_TEST_PGBOUNCER_URL", "pgbouncer")
}

/// A harness on `url`, a PgBouncer's with `dlock_pooler=transaction` (kept in `url`, so that
/// a child process handed it knows; `pool` takes it out and turns the statement cache off).
#[cfg(feature = "postgres")]
pub fn pgbouncer_at(url: &str, size: u32) -> Harness<diesel::PgConnection> {
    let mut url = url.to_owned();
    if !url.contains("sslmode") {
        url.push_str(if url.contains('?') {
            "&sslmode=disable"
        } else {
            "?sslmode=disable"
        });
    }
    server_at(&url, size)
}

/// PostgreSQL through the transaction-pooling PgBouncer.
#[cfg(feature = "postgres")]
pub fn pgbouncer_sized(size: u32) -> Option<Harness<diesel::PgConnection>> {
    Some(pgbouncer_at(&pgbouncer_url()?, size))
}

/// PostgreSQL through the transaction-pooling PgBouncer (which serves every database of the
/// server: `scripts/services.sh`), on a database of the test's own, made and dropped
/// directly on the server.
#[cfg(feature = "postgres")]
pub fn pgbouncer_own_db_sized(size: u32) -> Option<Harness<diesel::PgConnection>> {
    let bouncer = pgbouncer_url()?;
    Some(own_db_via(
        &pg_url()?,
        |name| vec![format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")],
        |name| pgbouncer_at(&with_database(&bouncer, name), size),
    ))
}

#[cfg(feature = "postgres")]
pub fn pgbouncer() -> Option<Harness<diesel::PgConnection>> {
    pgbouncer_sized(10)
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

/// MySQL/MariaDB, on a database of the test's own (for tests that purge). The test role may
/// create `dlock_t_%` databases (scripts/services.sh).
#[cfg(feature = "mysql")]
pub fn mysql_own_db_sized(size: u32) -> Option<Harness<diesel::MysqlConnection>> {
    let url = url("DLOCK_TEST_MYSQL_URL", "mysql")?;
    Some(own_db(&url, size, |name| {
        vec![
            // A connection left in a transaction on it would hold the DROP (for up to a year by
            // default): fail and say so instead.
            "SET SESSION lock_wait_timeout = 30".to_owned(),
            format!("DROP DATABASE IF EXISTS {name}"),
        ]
    }))
}

#[cfg(feature = "mysql")]
pub fn mysql_own_db() -> Option<Harness<diesel::MysqlConnection>> {
    mysql_own_db_sized(10)
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
        _db: None,
    })
}

/// Is a session of `c`'s database waiting for a row lock (MySQL/MariaDB)? What the server
/// shows of its transactions (`INNODB_TRX`) is refreshed only once nobody read it for
/// 100 ms: the tests that poll it run one at a time (the nextest group `innodb-trx`).
#[cfg(feature = "mysql")]
#[allow(dead_code)] // not every test binary waits for a lock wait
pub fn mysql_someone_waits(c: &mut diesel::MysqlConnection) -> bool {
    mysql_waiting(c) > 0
}

/// How many sessions of `c`'s database wait for a row lock (MySQL/MariaDB; see
/// `mysql_someone_waits`).
#[cfg(feature = "mysql")]
#[allow(dead_code)] // not every test binary waits for a lock wait
pub fn mysql_waiting(c: &mut diesel::MysqlConnection) -> i64 {
    use diesel::RunQueryDsl;
    #[derive(diesel::QueryableByName)]
    struct N {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        n: i64,
    }
    diesel::sql_query(
        "SELECT CAST(COUNT(*) AS SIGNED) AS n \
         FROM information_schema.INNODB_TRX t \
         JOIN information_schema.PROCESSLIST p ON p.ID = t.trx_mysql_thread_id \
         WHERE p.DB = DATABASE() AND t.trx_state = 'LOCK WAIT'",
    )
    .get_result::<N>(c)
    .unwrap()
    .n
}
