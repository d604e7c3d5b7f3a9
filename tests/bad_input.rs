//! Bad input gets a clear error before any SQL runs; missing tables and an exhausted pool get
//! errors of their own; the public types are Send/Sync/Clone as promised.

mod common;

use diesel::r2d2::{ConnectionManager, Pool};
use diesel_lock::{Error, LockConnection, LockGuard, Locker, Strategy};
use std::time::{Duration, Instant};

const LEASE: Strategy = Strategy::Lease {
    ttl: Duration::from_secs(10),
};
const ROW: Strategy = Strategy::Row { stale_after: None };

#[test]
fn public_types_are_send_sync_clone() {
    fn send_sync_clone<T: Send + Sync + Clone>() {}
    fn send<T: Send>() {}
    fn error<T: std::error::Error + Send + Sync + 'static>() {}
    send_sync_clone::<Locker<diesel::SqliteConnection>>();
    send_sync_clone::<Locker<diesel_lock::AnyConnection>>();
    send::<LockGuard<diesel::SqliteConnection>>();
    send::<LockGuard<diesel_lock::AnyConnection>>();
    error::<Error>();
    #[cfg(feature = "postgres")]
    send_sync_clone::<Locker<diesel::PgConnection>>();
    #[cfg(feature = "mysql")]
    send_sync_clone::<Locker<diesel::MysqlConnection>>();
}

/// Bad keys are refused before any SQL runs: these lockers never ran `migrate`, so a key
/// that reached the database would fail with `MissingTable` instead.
fn keys_are_checked_before_sql<C: LockConnection>(h: &common::Harness<C>) {
    for s in [ROW, LEASE] {
        let l = Locker::builder(h.pool.clone()).strategy(s).build().unwrap();
        for key in [
            String::new(),
            "a\0b".into(),
            "k".repeat(256),
            "é".repeat(128),
        ] {
            for result in [
                l.try_lock(&key).map(drop),
                l.try_lock_for(&key, Duration::from_millis(10)).map(drop),
                l.lock(&key).map(drop),
            ] {
                assert!(
                    matches!(result, Err(Error::InvalidKey { .. })),
                    "{key:?}: {result:?}"
                );
            }
        }
    }
}

/// Before `migrate`, every acquisition says the tables are missing (and how to fix it).
fn missing_tables_are_named<C: LockConnection>(h: &common::Harness<C>) {
    for s in [ROW, LEASE] {
        let l = Locker::builder(h.pool.clone()).strategy(s).build().unwrap();
        let err = l.try_lock("k").unwrap_err();
        assert!(matches!(err, Error::MissingTable(_)), "{err:?}");
        assert!(err.to_string().contains("migrate"), "{err}");
        assert!(std::error::Error::source(&err).is_some());
        // The first check gave a migration committed elsewhere up to a second to show; the
        // next ones answer at once.
        let started = std::time::Instant::now();
        let err = l.lock("k").unwrap_err();
        assert!(matches!(err, Error::MissingTable(_)), "{err:?}");
        let err = l.try_lock("k").unwrap_err();
        assert!(matches!(err, Error::MissingTable(_)), "{err:?}");
        assert!(
            started.elapsed() < Duration::from_millis(500),
            "later checks of an unmigrated database waited again: {:?}",
            started.elapsed()
        );
    }
}

#[test]
fn sqlite_keys_are_checked_before_sql() {
    keys_are_checked_before_sql(&common::sqlite().unwrap());
}

#[test]
fn sqlite_missing_tables_are_named() {
    missing_tables_are_named(&common::sqlite().unwrap());
}

/// A database of its own, so no other test has migrated it.
#[cfg(feature = "postgres")]
fn fresh_pg_schema() -> Option<(common::Harness<diesel::PgConnection>, DropSchema)> {
    use diesel::connection::SimpleConnection;
    let h = common::pg_sized(2)?;
    // The migrated tables live in `public`: a search path of one fresh, empty schema hides
    // them. (A generated identifier, not a value: identifiers cannot be bound.)
    let schema = format!("fresh_{}", common::unique_key("s").replace('-', "_"));
    let mut c = h.pool.get().unwrap();
    c.batch_execute(&format!("CREATE SCHEMA {schema}")).unwrap();
    drop(c);
    let url = format!("{}&options=-csearch_path%3D{schema}", h.url);
    Some((common::server_at(&url, 2), DropSchema(h, schema)))
}

/// Drops the test's schema when the test ends.
#[cfg(feature = "postgres")]
struct DropSchema(common::Harness<diesel::PgConnection>, String);

#[cfg(feature = "postgres")]
impl Drop for DropSchema {
    fn drop(&mut self) {
        use diesel::connection::SimpleConnection;
        if let Ok(mut c) = self.0.pool.get() {
            let _ = c.batch_execute(&format!("DROP SCHEMA IF EXISTS {} CASCADE", self.1));
        }
    }
}

#[cfg(feature = "postgres")]
#[test]
fn pg_keys_are_checked_before_sql() {
    if let Some((h, _drop)) = fresh_pg_schema() {
        keys_are_checked_before_sql(&h);
    }
}

#[cfg(feature = "postgres")]
#[test]
fn pg_missing_tables_are_named() {
    if let Some((h, _drop)) = fresh_pg_schema() {
        missing_tables_are_named(&h);
    }
}

/// A database left by an older version (only the first migration applied, as a process
/// that is still migrating also shows it): a `Row` attempt is `MissingTable`, which says to
/// migrate, not a raw "no such column"; after `migrate` it works.
fn older_schema_says_migrate<C: LockConnection + diesel::connection::SimpleConnection>(
    h: &common::Harness<C>,
    first_migration: &str,
) {
    h.pool
        .get()
        .unwrap()
        .batch_execute(first_migration)
        .unwrap();
    let l = Locker::builder(h.pool.clone())
        .strategy(ROW)
        .build()
        .unwrap();
    let err = l.try_lock("k").unwrap_err();
    assert!(matches!(err, Error::MissingTable(_)), "{err:?}");
    assert!(err.to_string().contains("migrate"), "{err}");
    l.migrate().unwrap();
    l.try_lock("k").unwrap().expect("free").release().unwrap();
}

#[test]
fn sqlite_older_schema_says_migrate() {
    older_schema_says_migrate(
        &common::sqlite().unwrap(),
        include_str!("../migrations/sqlite/00000000000001_dlock_init/up.sql"),
    );
}

#[cfg(feature = "postgres")]
#[test]
fn pg_older_schema_says_migrate() {
    if let Some((h, _drop)) = fresh_pg_schema() {
        older_schema_says_migrate(
            &h,
            include_str!("../migrations/postgres/00000000000001_dlock_init/up.sql"),
        );
    }
}

#[test]
fn bad_configuration_is_refused_at_build() {
    let h = common::sqlite().unwrap();
    let build = |s: Strategy| Locker::builder(h.pool.clone()).strategy(s).build();
    let century = Duration::from_secs(100 * 365 * 24 * 3600);
    for ttl in [
        Duration::ZERO,
        Duration::from_micros(999),
        century * 2,
        Duration::MAX,
    ] {
        assert!(matches!(
            build(Strategy::Lease { ttl }),
            Err(Error::InvalidConfig(_))
        ));
    }
    for stale in [Duration::ZERO, century * 2, Duration::MAX] {
        assert!(matches!(
            build(Strategy::Row {
                stale_after: Some(stale)
            }),
            Err(Error::InvalidConfig(_))
        ));
    }
    let builder = || Locker::builder(h.pool.clone()).strategy(LEASE);
    for every in [
        Duration::ZERO,
        Duration::from_secs(10),
        Duration::from_secs(11),
    ] {
        let r = builder().heartbeat(every).build();
        assert!(
            matches!(r, Err(Error::InvalidConfig(_))),
            "heartbeat {every:?}"
        );
    }
    for owner in [String::new(), "o".repeat(256), "a\0b".into()] {
        let r = builder().owner(owner.clone()).build();
        assert!(matches!(r, Err(Error::InvalidConfig(_))), "owner {owner:?}");
    }
    let r = builder().max_backoff(Duration::ZERO).build();
    assert!(matches!(r, Err(Error::InvalidConfig(_))));
    let err = build(Strategy::Lease {
        ttl: Duration::ZERO,
    })
    .unwrap_err();
    assert!(
        err.to_string().starts_with("invalid lock configuration"),
        "{err}"
    );
    // The limits themselves are accepted.
    builder().owner("o".repeat(255)).build().unwrap();
    build(Strategy::Lease {
        ttl: Duration::from_millis(1),
    })
    .unwrap();
}

#[test]
fn urls_are_checked() {
    for url in ["", "   ", "redis://127.0.0.1/", ":memory:", "sqlite://"] {
        let err = diesel_lock::connect(url).unwrap_err();
        assert!(matches!(err, Error::InvalidUrl(_)), "{url:?}: {err:?}");
    }
    #[cfg(feature = "postgres")]
    {
        // Nothing listens on port 1: the driver's reason comes through, the password does not.
        let err = diesel_lock::connect("postgres://u:hunter2@127.0.0.1:1/db").unwrap_err();
        assert!(matches!(err, Error::Connection { .. }), "{err:?}");
        let why = std::error::Error::source(&err).unwrap().to_string();
        assert!(why.contains("127.0.0.1"), "{why}");
        assert!(!format!("{err} {why} {err:?}").contains("hunter2"));
    }
}

/// Every connection of the pool taken elsewhere: waiting ends with `Error::Pool` once the
/// deadline (or the pool's own `connection_timeout`) passes, never a hang.
#[test]
fn an_exhausted_pool_is_an_error_not_a_hang() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("l.db");
    // The tables first, through a pool of no hurry: on a loaded machine opening the file
    // can itself take longer than the 300 ms this test is about (seen once: `build` failed).
    let setup = common::sqlite_at(path.to_str().unwrap(), 1);
    setup.locker(LEASE);
    let pool = Pool::builder()
        .max_size(1)
        .connection_timeout(Duration::from_millis(300))
        .connection_customizer(Box::new(diesel_lock::SqliteTuning::default()))
        .build_unchecked(ConnectionManager::<diesel::SqliteConnection>::new(
            path.to_str().unwrap(),
        ));
    let l = Locker::builder(pool.clone())
        .strategy(LEASE)
        .build()
        .unwrap();
    let _all = pool.get_timeout(Duration::from_secs(30)).unwrap();
    let start = Instant::now();
    let err = l.try_lock_for("k", Duration::from_millis(100)).unwrap_err();
    assert!(matches!(err, Error::Pool(_)), "{err:?}");
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );
    let start = Instant::now();
    assert!(matches!(l.lock("k"), Err(Error::Pool(_))));
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(3),
        "{took:?}"
    );
}
