//! Errors that say why: a `Locker` built from a URL (`Locker::connect`) names the driver's
//! reason for a connection that failed (connection refused, authentication failed, unknown
//! database, TLS required, a SQLite file that cannot be opened), at `connect` and later from
//! its pool; a wait that meets an outage ends in `Error::Unreachable`, not in "held
//! elsewhere"; the pool can be sized, and a pool emptied by the `Locker`'s own guards says so.
//! Passwords appear in no message.
//!
//! Real servers: the shared PostgreSQL and MariaDB for what does not stop them, private ones
//! (`common::private_server`) for the outages.

mod common;

use diesel_lock::{ConnectFailure, Error, Locker, Strategy};
use std::error::Error as _;
use std::time::{Duration, Instant};

/// The error, its Display and its whole source chain, on one line.
fn chain(e: &Error) -> String {
    let mut s = format!("{e}");
    let mut source = e.source();
    while let Some(cause) = source {
        s.push_str(" / ");
        s.push_str(&cause.to_string());
        source = cause.source();
    }
    s
}

/// `Locker::connect(url)` fails with `Error::Connection` of `failure`: its Display names the
/// failure, its source is the driver's message, containing `driver_says`, and no message or
/// debug output contains `password`.
fn refused_as(url: &str, failure: ConnectFailure, driver_says: &str, password: &str) {
    let err = match Locker::connect(url) {
        Ok(_) => panic!("{failure:?}: connected"),
        Err(e) => e,
    };
    let all = chain(&err);
    eprintln!("{failure:?}: {all}");
    match &err {
        Error::Connection { failure: f, .. } => assert_eq!(*f, failure, "{all}"),
        other => panic!("{failure:?}: {other:?}"),
    }
    assert!(err.to_string().contains(&failure.to_string()), "{all}");
    let driver = err.source().expect("the driver's error").to_string();
    assert!(
        driver.to_lowercase().contains(&driver_says.to_lowercase()),
        "{failure:?}: {driver}"
    );
    assert!(
        !format!("{all} {err:?}").contains(password),
        "{all} {err:?}"
    );
}

/// `url` with another password, database or port (`postgres://user:pw@host:port/db?…`).
fn with(url: &str, password: Option<&str>, port: Option<u16>, db: Option<&str>) -> String {
    let (scheme, rest) = url.split_once("://").unwrap();
    let (auth, rest) = rest.split_once('@').unwrap();
    let (hostport, rest) = rest.split_once('/').unwrap();
    let (dbname, query) = match rest.split_once('?') {
        Some((d, q)) => (d, Some(q)),
        None => (rest, None),
    };
    let user = auth.split_once(':').map_or(auth, |(u, _)| u);
    let host = hostport.split_once(':').map_or(hostport, |(h, _)| h);
    let port = match port {
        Some(p) => p.to_string(),
        None => hostport.split_once(':').map_or("", |(_, p)| p).to_owned(),
    };
    let auth = match password {
        Some(p) => format!("{user}:{p}"),
        None => auth.to_owned(),
    };
    let mut out = format!("{scheme}://{auth}@{host}:{port}/{}", db.unwrap_or(dbname));
    if let Some(q) = query {
        out.push('?');
        out.push_str(q);
    }
    out
}

/// A port of 127.0.0.1 that nothing listens on (bound a moment ago, then let go).
fn closed_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
        .port()
}

#[cfg(feature = "postgres")]
#[test]
fn pg_connect_names_the_cause() {
    let Some(url) = common::url("DLOCK_TEST_PG_URL", "pg") else {
        return;
    };
    let secret = "Wr0ngPassw0rd";
    refused_as(
        &with(&url, Some(secret), Some(closed_port()), None),
        ConnectFailure::Refused,
        "connection refused",
        secret,
    );
    // The shared server trusts loopback clients (no password asked): an unknown user.
    let nobody = url.replacen("://dlock", "://no_such_user_dlock", 1);
    assert_ne!(nobody, url);
    refused_as(
        &nobody,
        ConnectFailure::Authentication,
        "does not exist",
        secret,
    );
    refused_as(
        &with(&url, None, None, Some("no_such_db_dlock")),
        ConnectFailure::UnknownDatabase,
        "does not exist",
        secret,
    );
    if !common::private_server::available("pg") {
        return;
    }
    // A private server, which asks loopback clients for a password, and has no TLS.
    let server = common::private_server::PrivatePg::start();
    {
        use diesel::connection::SimpleConnection;
        use diesel::Connection;
        let mut admin = diesel::PgConnection::establish(&server.url()).unwrap();
        admin
            .batch_execute("ALTER ROLE postgres PASSWORD 'R1ghtPassword'")
            .unwrap();
        std::fs::write(
            server.data_dir().join("pg_hba.conf"),
            "local all all trust\nhost all all 127.0.0.1/32 scram-sha-256\n",
        )
        .unwrap();
        admin.batch_execute("SELECT pg_reload_conf()").unwrap();
    }
    let wrong = server
        .url()
        .replace("postgres@", &format!("postgres:{secret}@"));
    refused_as(
        &wrong,
        ConnectFailure::Authentication,
        "password authentication failed",
        secret,
    );
    let url = server
        .url()
        .replace("postgres@", "postgres:R1ghtPassword@")
        .replace("sslmode=disable", "sslmode=require");
    refused_as(&url, ConnectFailure::TlsRequired, "SSL", "R1ghtPassword");
}

#[cfg(feature = "mysql")]
#[test]
fn mysql_connect_names_the_cause() {
    let Some(url) = common::url("DLOCK_TEST_MYSQL_URL", "mysql") else {
        return;
    };
    let secret = "Wr0ngPassw0rd";
    refused_as(
        &with(&url, Some(secret), Some(closed_port()), None),
        ConnectFailure::Refused,
        "can't connect",
        secret,
    );
    refused_as(
        &with(&url, Some(secret), None, None),
        ConnectFailure::Authentication,
        "access denied",
        secret,
    );
    refused_as(
        &with(&url, None, None, Some("no_such_db_dlock")),
        ConnectFailure::UnknownDatabase,
        // To a user without rights on every database, MariaDB does not say "unknown".
        "to database 'no_such_db_",
        secret,
    );
    // TLS required by the server (MariaDB's client library ignores the URL's ssl_mode): a
    // private server, without TLS, told to refuse connections without it. MariaDB words
    // that refusal as it words a wrong password ("Access denied"), so the driver's message
    // cannot tell the two apart: `Authentication`, as documented on `TlsRequired`.
    if !common::private_server::available("mysql") {
        return;
    }
    let server = common::private_server::PrivateMaria::start();
    {
        use diesel::connection::SimpleConnection;
        use diesel::Connection;
        let mut admin = diesel::MysqlConnection::establish(&server.admin_url()).unwrap();
        admin
            .batch_execute("SET GLOBAL require_secure_transport = ON")
            .unwrap();
    }
    refused_as(
        &server.url(),
        ConnectFailure::Authentication,
        "access denied",
        secret,
    );
}

#[cfg(feature = "sqlite")]
#[test]
fn sqlite_connect_names_the_cause() {
    refused_as(
        "/nonexistent-dir-dlock/locks.db",
        ConnectFailure::CannotOpen,
        "unable to open the database file",
        "nothing",
    );
}

/// After the server went away, the pool's errors still say why (before: r2d2's
/// `Pool(Error(None))`, or diesel's "Invalid connection url for multiconnection").
fn later_failures_name_the_cause(url: &str, stop: impl FnOnce()) {
    let locker = Locker::connect(url).unwrap().build().unwrap();
    locker.migrate().unwrap();
    drop(locker.try_lock(&common::unique_key("before")).unwrap());
    stop();
    let err = locker
        .try_lock(&common::unique_key("after"))
        .expect_err("the server is down");
    let all = chain(&err);
    eprintln!("{all}");
    assert!(
        matches!(
            err,
            Error::Connection {
                failure: ConnectFailure::Refused,
                ..
            }
        ),
        "{all}"
    );
    assert!(!all.contains("multiconnection"), "{all}");
}

/// With the server stopped after a first lock, `try_lock_for` ends at its deadline with
/// `Error::Unreachable` naming the cause (before: `Ok(None)`, "another process holds it");
/// a server that comes back before the deadline still gives the lock.
fn outage_is_an_error_at_the_deadline<S: Send + 'static>(
    url: &str,
    strategy: Strategy,
    mut server: S,
    stop: impl Fn(&mut S),
    restart: fn(&mut S),
) -> S {
    let locker = Locker::connect(url)
        .unwrap()
        .strategy(strategy)
        .build()
        .unwrap();
    locker.migrate().unwrap();
    let key = common::unique_key("outage");
    drop(locker.lock(&key).unwrap());
    stop(&mut server);
    // Four threads of the Locker wait together: one asks the database, the others wait
    // behind it in the Locker's own line; each must say the database is unreachable.
    let start = Instant::now();
    let barrier = std::sync::Barrier::new(4);
    let mut answers: Vec<_> = std::thread::scope(|s| {
        let waits: Vec<_> = (0..4)
            .map(|_| {
                s.spawn(|| {
                    barrier.wait();
                    locker.try_lock_for(&key, Duration::from_secs(2))
                })
            })
            .collect();
        waits.into_iter().map(|w| w.join().unwrap()).collect()
    });
    let took = start.elapsed();
    for other in answers.split_off(1) {
        match other {
            Err(Error::Unreachable { key: k, .. }) => assert_eq!(k, key),
            Err(e) => panic!("{}: a waiter behind: {e}", strategy.name()),
            Ok(g) => panic!(
                "{}: a waiter behind: {:?} in an outage",
                strategy.name(),
                g.map(|g| g.token())
            ),
        }
    }
    let r = answers.pop().unwrap();
    let err = match r {
        Err(e) => e,
        Ok(g) => panic!(
            "{}: {:?} after {took:?}",
            strategy.name(),
            g.map(|g| g.token())
        ),
    };
    let all = chain(&err);
    eprintln!("{}: {all} (after {took:?})", strategy.name());
    match &err {
        Error::Unreachable { key: k, source } => {
            assert_eq!(*k, key);
            assert!(
                matches!(
                    **source,
                    Error::Connection {
                        failure: ConnectFailure::Refused,
                        ..
                    }
                ),
                "{all}"
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(took >= Duration::from_secs(2), "gave up early: {took:?}");
    // Down when the wait begins, back before its deadline: the lock.
    assert!(locker.try_lock(&key).is_err(), "the server is still down");
    let restarter = std::thread::spawn(move || {
        restart(&mut server);
        server
    });
    let got = locker.try_lock_for(&key, Duration::from_secs(60));
    let server = restarter.join().unwrap();
    assert!(matches!(got, Ok(Some(_))), "{:?}", got.map(|g| g.is_some()));
    server
}

#[cfg(feature = "postgres")]
#[test]
fn pg_outages_say_why() {
    use common::private_server::{available, PrivatePg};
    if !available("pg") {
        return;
    }
    let mut server = PrivatePg::start();
    let url = server.url();
    later_failures_name_the_cause(&url, || server.stop_clean());
    server.restart();
    for s in [
        Strategy::Lease {
            ttl: Duration::from_secs(30),
        },
        Strategy::Advisory,
    ] {
        server = outage_is_an_error_at_the_deadline(
            &url,
            s,
            server,
            PrivatePg::stop_clean,
            PrivatePg::restart,
        );
    }
}

#[cfg(feature = "mysql")]
#[test]
fn maria_outages_say_why() {
    use common::private_server::{available, PrivateMaria};
    if !available("mysql") {
        return;
    }
    let mut server = PrivateMaria::start();
    let url = server.url();
    later_failures_name_the_cause(&url, || server.stop_clean());
    server.restart();
    for s in [
        Strategy::Lease {
            ttl: Duration::from_secs(30),
        },
        Strategy::Advisory,
    ] {
        server = outage_is_an_error_at_the_deadline(
            &url,
            s,
            server,
            PrivateMaria::stop_clean,
            PrivateMaria::restart,
        );
    }
}

/// The pool of `Locker::connect` can be sized (builder, or `dlock_pool_size` in the URL);
/// `try_lock` on a pool that the `Locker`'s own session guards have emptied is one attempt
/// that says so, not a wait of the pool's whole 10 s connection timeout ending in a bare
/// "no connection".
fn a_pool_emptied_by_guards_says_so(url: &str) {
    let sep = if url.contains('?') { '&' } else { '?' };
    let sized = Locker::connect(&format!("{url}{sep}dlock_pool_size=3"))
        .unwrap()
        .build()
        .unwrap();
    assert_eq!(sized.pool().max_size(), 3);
    let overridden = Locker::connect(&format!("{url}{sep}dlock_pool_size=3"))
        .unwrap()
        .pool_size(5)
        .build()
        .unwrap();
    assert_eq!(overridden.pool().max_size(), 5);
    assert_eq!(
        Locker::connect(url)
            .unwrap()
            .build()
            .unwrap()
            .pool()
            .max_size(),
        10,
        "the documented default"
    );
    let own = Locker::builder(sized.pool().clone()).pool_size(4).build();
    assert!(matches!(own, Err(Error::InvalidConfig(_))), "{own:?}");

    // ForUpdate guards keep a connection each (Advisory guards share theirs: tests/mux.rs).
    let locker = Locker::connect(url)
        .unwrap()
        .strategy(Strategy::ForUpdate)
        .pool_size(2)
        .build()
        .unwrap();
    locker.migrate().unwrap();
    let held: Vec<_> = (0..2)
        .map(|i| {
            locker
                .lock(&common::unique_key(&format!("held-{i}")))
                .unwrap()
        })
        .collect();
    let other = common::unique_key("other");
    let start = Instant::now();
    let err = locker.try_lock(&other).expect_err("no connection left");
    let took = start.elapsed();
    let text = err.to_string();
    eprintln!("{text} (after {took:?})");
    assert!(
        matches!(
            err,
            Error::PoolExhausted {
                size: 2,
                held_by_guards: 2
            }
        ),
        "{err:?}"
    );
    assert!(text.contains("2 of them by this Locker's guards"), "{text}");
    assert!(text.contains("pool_size"), "{text}");
    // One attempt, not the pool's 10 s connection timeout.
    assert!(took < Duration::from_secs(5), "{took:?}");
    drop(held);
    assert!(locker.try_lock(&other).unwrap().is_some());
}

#[cfg(feature = "postgres")]
#[test]
fn pg_a_pool_emptied_by_guards_says_so() {
    if let Some(url) = common::url("DLOCK_TEST_PG_URL", "pg") {
        a_pool_emptied_by_guards_says_so(&url);
    }
}

#[cfg(feature = "mysql")]
#[test]
fn mysql_a_pool_emptied_by_guards_says_so() {
    if let Some(url) = common::url("DLOCK_TEST_MYSQL_URL", "mysql") {
        a_pool_emptied_by_guards_says_so(&url);
    }
}

/// A `Locker` built from a URL keeps it: on PostgreSQL its waiters hear releases on a
/// `LISTEN`ing connection to that URL (our own parameters taken out: libpq would refuse
/// `dlock_pool_size`), with no process-wide list of URLs and no mark on the pool's
/// connections.
#[cfg(feature = "postgres")]
#[test]
fn pg_a_locker_from_a_url_listens_on_it() {
    use diesel::sql_types::BigInt;
    use diesel::{Connection, QueryableByName, RunQueryDsl};
    let Some(url) = common::url("DLOCK_TEST_PG_URL", "pg") else {
        return;
    };
    let app = format!("dlock-h2-{}", std::process::id());
    let sep = if url.contains('?') { '&' } else { '?' };
    let own = format!("{url}{sep}dlock_pool_size=3&application_name={app}");
    let lease = Strategy::Lease {
        ttl: Duration::from_secs(30),
    };
    let locker = Locker::connect(&own)
        .unwrap()
        .strategy(lease)
        .max_backoff(Duration::from_secs(2))
        .build()
        .unwrap();
    locker.migrate().unwrap();
    let holder = Locker::builder(common::pool::<diesel::PgConnection>(&url, 2))
        .strategy(lease)
        .build()
        .unwrap();
    let key = common::unique_key("listens");
    let held = holder.lock(&key).unwrap();
    let waiter = {
        let (l, k) = (locker.clone(), key.clone());
        std::thread::spawn(move || {
            l.try_lock_for(&k, Duration::from_secs(60))
                .map(|g| g.is_some())
        })
    };
    #[derive(QueryableByName)]
    struct N {
        #[diesel(sql_type = BigInt)]
        n: i64,
    }
    let mut watch = diesel::PgConnection::establish(&url).unwrap();
    let give_up = Instant::now() + Duration::from_secs(30);
    loop {
        let n = diesel::sql_query(
            "SELECT count(*) AS n FROM pg_stat_activity \
             WHERE application_name = $1 AND query LIKE 'LISTEN%'",
        )
        .bind::<diesel::sql_types::Text, _>(&app)
        .get_result::<N>(&mut watch)
        .unwrap()
        .n;
        if n == 1 {
            break;
        }
        assert!(
            Instant::now() < give_up,
            "no LISTEN session on the Locker's URL"
        );
        std::thread::yield_now();
    }
    held.release().unwrap();
    assert!(waiter.join().unwrap().unwrap(), "the waiter got the key");
    assert_eq!(locker.pool().max_size(), 3);
}
