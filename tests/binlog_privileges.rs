//! MariaDB with a binary log, used by an ordinary user: one given exactly the privileges the
//! library needs (`GRANTS`: SELECT, INSERT, UPDATE, DELETE, CREATE, ALTER on its database),
//! no SUPER. With binary logging on, MariaDB lets only a user with
//! SUPER (or `log_bin_trust_function_creators = 1`) create a trigger, function or procedure,
//! so a migration that creates one fails for everybody else; nothing else the library does
//! needs more than `GRANTS`.
//!
//! The user runs `Locker::migrate()` and then every strategy of the MySQL backend (Row, Lease,
//! ForUpdate, Advisory; their readers, writers and permits where they have them), each with
//! increasing tokens, and a cancelled wait in the server's lock queue (ended by `KILL
//! CONNECTION` of its own session, which a user may do without any privilege).
//!
//! A database migrated by an older version has a Row trigger (`OLD_ROW_TRIGGER`, from
//! migration 1 as it was): the admin creates it by hand, the ordinary user's `migrate()`
//! works beside it, and Row locks taken by that user have strictly increasing tokens.
//!
//! Each test runs a private server of its own (`PrivateMaria`), never a shared one.
#![cfg(feature = "mysql")]

mod common;

use common::private_server::{self, PrivateMaria};
use diesel::connection::SimpleConnection;
use diesel::sql_types::BigInt;
use diesel::{Connection, MysqlConnection, QueryableByName, RunQueryDsl};
use diesel_lock::{Cancel, Error, Locker, Strategy};
use std::time::{Duration, Instant};

/// Everything the library needs, on its database only (see docs/replication.md):
/// - SELECT, INSERT, UPDATE, DELETE: the lock tables' rows, and diesel's record of the
///   migrations (`__diesel_schema_migrations`);
/// - CREATE: `migrate()`'s CREATE TABLE (their keys and indexes are declared in it: no INDEX
///   needed), and diesel's own table;
/// - ALTER: `migrate()`'s ALTER TABLE … ADD COLUMN (migrations 4 and 5).
///
/// Not needed (each found unneeded by running this test without it, with the others):
/// INDEX; DROP (only reverting migrations drops tables, which `migrate()` never does); PROCESS
/// (the library reads no session from PROCESSLIST); SUPER / CONNECTION ADMIN (a cancelled
/// wait kills a session of the same user, which needs no privilege); TRIGGER, CREATE ROUTINE,
/// EXECUTE (no trigger, function or procedure); CREATE TEMPORARY TABLES, LOCK TABLES,
/// REFERENCES, RELOAD.
///
/// `DLOCK_TEST_GRANTS` replaces the list, to try another (e.g. one privilege fewer).
const GRANTS: &str = "SELECT, INSERT, UPDATE, DELETE, CREATE, ALTER";

/// Enough for a user that takes locks but never runs `migrate()` (another user did).
const RUN_GRANTS: &str = "SELECT, INSERT, UPDATE, DELETE";

/// The Row trigger of migration 1 (`migrations/mysql/00000000000001_dlock_init/up.sql`) as it
/// was until the tokens carried the server's epoch (main at 6b14d75), copied verbatim but for its last `;`: a
/// database migrated by such a version has it.
const OLD_ROW_TRIGGER: &str = "\
CREATE TRIGGER IF NOT EXISTS dlock_rows_token BEFORE INSERT ON dlock_rows FOR EACH ROW
BEGIN
    INSERT INTO dlock_tokens (lock_key, token) VALUES (NEW.lock_key, 1)
        ON DUPLICATE KEY UPDATE token = token + 1;
    SET NEW.token = (SELECT token FROM dlock_tokens WHERE lock_key = NEW.lock_key);
END";

/// A server with a binary log (MIXED, the default format), and `app` (password `app`) with
/// `GRANTS` on `dlock.*` only.
fn server() -> Option<PrivateMaria> {
    if !private_server::available("mysql") {
        return None;
    }
    let started = Instant::now();
    let m = PrivateMaria::start_configured(
        &[],
        &[
            "--log-bin=mysql-bin",
            "--server-id=7",
            "--binlog-format=MIXED",
        ],
    );
    let grants = std::env::var("DLOCK_TEST_GRANTS").unwrap_or_else(|_| GRANTS.to_owned());
    eprintln!("app has {grants} on dlock.*");
    let mut admin = MysqlConnection::establish(&m.admin_url()).unwrap();
    admin
        .batch_execute(&format!(
            "CREATE USER 'app'@'%' IDENTIFIED BY 'app'; GRANT {grants} ON dlock.* TO 'app'@'%';"
        ))
        .unwrap();
    assert_eq!(
        value(&mut admin, "SELECT CAST(@@log_bin AS SIGNED) AS v"),
        1
    );
    eprintln!("server with a binary log up in {:?}", started.elapsed());
    Some(m)
}

#[derive(QueryableByName)]
struct V {
    #[diesel(sql_type = BigInt)]
    v: i64,
}

fn value(c: &mut MysqlConnection, sql: &str) -> i64 {
    diesel::sql_query(sql).get_result::<V>(c).unwrap().v
}

fn app_url(m: &PrivateMaria) -> String {
    m.url_as("app", "app")
}

fn locker(url: &str, s: Strategy, size: u32) -> Locker<MysqlConnection> {
    Locker::builder(common::pool::<MysqlConnection>(url, size))
        .strategy(s)
        .build()
        .unwrap()
}

fn strictly_increasing(what: &str, tokens: &[i64]) {
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "{what}: tokens do not strictly increase: {tokens:?}"
    );
}

/// Exclusive locks: taken and released, then two in a row by two `Locker`s.
fn exclusive(l: &Locker<MysqlConnection>, other: &Locker<MysqlConnection>, key: &str) {
    let mut tokens = Vec::new();
    for i in 0..6 {
        let by = if i % 2 == 0 { l } else { other };
        let g = by.lock(key).unwrap();
        g.check().unwrap();
        assert!(other.try_lock(key).unwrap().is_none(), "{key}: two holders");
        tokens.push(g.token());
        g.release().unwrap();
    }
    strictly_increasing(key, &tokens);
}

/// Whether `l` has the mode `try_mode` asks for (else `Error::Unsupported`, or
/// `Error::Incompatible` for `Advisory` permits, which `GET_LOCK` cannot make exclude the
/// key's exclusive lock).
fn has_mode(
    try_mode: diesel_lock::Result<Option<diesel_lock::LockGuard<MysqlConnection>>>,
) -> bool {
    match try_mode {
        Err(Error::Unsupported { .. } | Error::Incompatible { .. }) => false,
        Ok(Some(g)) => {
            g.release().unwrap();
            true
        }
        other => panic!("probing a mode: {other:?}"),
    }
}

/// Two readers at once, then a writer, twice; two permits of two, twice; each where the
/// strategy has them. Returns the modes it ran ("read", "write", "permit").
fn shared_modes(l: &Locker<MysqlConnection>, key: &str) -> Vec<&'static str> {
    let rw = format!("{key}-rw");
    let sem = format!("{key}-sem");
    let readers = has_mode(l.try_read(&rw));
    let writers = has_mode(l.try_write(&rw));
    let permits = has_mode(l.try_permit(&sem, 2));
    let mut tokens = Vec::new();
    for _ in 0..2 {
        if readers {
            let a = l.read(&rw).unwrap();
            let b = l.read(&rw).unwrap();
            a.check().unwrap();
            b.check().unwrap();
            if writers {
                assert!(
                    l.try_write(&rw).unwrap().is_none(),
                    "{rw}: a writer beside readers"
                );
            }
            tokens.extend([a.token(), b.token()]);
            drop((a, b));
        }
        if writers {
            let w = l.write(&rw).unwrap();
            if readers {
                assert!(
                    l.try_read(&rw).unwrap().is_none(),
                    "{rw}: a reader beside a writer"
                );
            }
            tokens.push(w.token());
            w.release().unwrap();
        }
    }
    strictly_increasing(&rw, &tokens);
    let mut tokens = Vec::new();
    for _ in 0..2 {
        if permits {
            let a = l.permit(&sem, 2).unwrap();
            let b = l.permit(&sem, 2).unwrap();
            assert!(
                l.try_permit(&sem, 2).unwrap().is_none(),
                "{sem}: a third of two"
            );
            tokens.extend([a.token(), b.token()]);
            a.release().unwrap();
            b.release().unwrap();
        }
    }
    strictly_increasing(&sem, &tokens);
    [(readers, "read"), (writers, "write"), (permits, "permit")]
        .into_iter()
        .filter_map(|(on, name)| on.then_some(name))
        .collect()
}

/// A wait in the server's lock queue (GET_LOCK, SELECT … FOR UPDATE) ended by `cancel`: the
/// `Locker` kills the waiting session from another of its connections, as `app`.
fn cancelled_server_wait(m: &PrivateMaria, user: &str, s: Strategy) {
    let key = format!("cancel-{}", s.name());
    let url = m.url_as(user, user);
    let holder = locker(&url, s, 2);
    let held = holder.lock(&key).unwrap();
    let waiter = locker(&url, s, 2);
    let cancel = Cancel::new();
    let thread = {
        let (waiter, cancel, key) = (waiter.clone(), cancel.clone(), key.clone());
        std::thread::spawn(move || waiter.try_lock_cancellable(&key, None, &cancel))
    };
    // The admin sees the user's waiting session (the user needs no PROCESS for anything).
    let mut admin = MysqlConnection::establish(&m.admin_url()).unwrap();
    let waiting = &format!(
        "SELECT COUNT(*) AS v FROM information_schema.PROCESSLIST \
         WHERE USER = '{user}' AND TIME_MS > 50 \
           AND (INFO LIKE '%GET_LOCK%' OR INFO LIKE '%FOR UPDATE%')"
    );
    let started = Instant::now();
    while value(&mut admin, waiting) == 0 {
        assert!(started.elapsed() < Duration::from_secs(20), "never waited");
        std::thread::sleep(Duration::from_millis(10));
    }
    let cancelled = Instant::now();
    cancel.cancel();
    let got = thread.join().unwrap();
    let ended = cancelled.elapsed();
    assert!(
        got.as_ref().is_ok_and(|g| g.is_none()),
        "{}: a cancelled wait as {user}: {got:?}",
        s.name()
    );
    assert!(
        ended < Duration::from_secs(5),
        "{}: took {ended:?}",
        s.name()
    );
    // The session was ended in the server, not only given up by the client.
    let started = Instant::now();
    while value(&mut admin, waiting) != 0 {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{}: the waiting session outlived the cancel",
            s.name()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    eprintln!(
        "{}: the cancelled wait ended {ended:?} after cancel",
        s.name()
    );
    held.check().unwrap();
    held.release().unwrap();
    let again = waiter
        .try_lock_for(&key, Duration::from_secs(5))
        .unwrap()
        .expect("free after the release");
    again.release().unwrap();
}

/// As `user` (password: its name), on the server `m` (migrated): every strategy with every
/// mode it has, and a cancelled wait in the server's lock queue for the session strategies.
fn every_strategy(m: &PrivateMaria, user: &str) {
    let url = m.url_as(user, user);
    let lease = Strategy::Lease {
        ttl: Duration::from_secs(30),
    };
    for s in [
        Strategy::Row { stale_after: None },
        Strategy::Row {
            stale_after: Some(Duration::from_secs(60)),
        },
        lease,
        Strategy::ForUpdate,
        Strategy::Advisory,
    ] {
        let t = Instant::now();
        let (a, b) = (locker(&url, s, 4), locker(&url, s, 4));
        exclusive(&a, &b, &format!("ex-{}", s.name()));
        let modes = shared_modes(&a, s.name());
        let expected: &[&str] = match s {
            Strategy::Row { .. } => &[],
            Strategy::Lease { .. } => &["read", "write", "permit"],
            Strategy::ForUpdate => &["read", "write", "permit"],
            _ => &[],
        };
        assert_eq!(modes, expected, "{}: the modes it has", s.name());
        eprintln!(
            "{}: lock, {modes:?} as {user} in {:?}",
            s.name(),
            t.elapsed()
        );
    }
    cancelled_server_wait(m, user, Strategy::ForUpdate);
    cancelled_server_wait(m, user, Strategy::Advisory);
}

/// As `app`: `migrate()`, then every strategy, mode and a cancelled server-side wait.
#[test]
fn an_ordinary_user_migrates_and_locks_with_a_binary_log() {
    let Some(m) = server() else { return };
    let url = app_url(&m);
    let started = Instant::now();
    let l = locker(&url, Strategy::Row { stale_after: None }, 4);
    if let Err(e) = l.migrate() {
        panic!("migrate() as an ordinary user with a binary log: {e} ({e:?})");
    }
    eprintln!("migrate() as app: {:?}", started.elapsed());
    every_strategy(&m, "app");
    // And `migrate()` again (nothing pending) works too.
    l.migrate().unwrap();
}

/// An existing database, migrated when migration 1 made the Row trigger (migrations 1 to 10,
/// by an admin, since creating the trigger needed SUPER): `app`'s `migrate()` works, leaves
/// the trigger (dropping it needs SUPER here too), and Row locks taken by `app` have strictly
/// increasing tokens, from several threads, all above every token the trigger stamped.
/// (Where the user may drop it, migration 11 does: tests/migrations.rs.)
#[test]
fn a_database_with_the_old_row_trigger_is_migrated_by_an_ordinary_user() {
    let Some(m) = server() else { return };
    // The old database: the admin migrates, makes the trigger as migration 1 did, and takes
    // Row locks through it; the migrations from 11 on are then "not applied yet".
    let admin = locker(&m.admin_url(), Strategy::Row { stale_after: None }, 2);
    admin.migrate().unwrap();
    let mut c = MysqlConnection::establish(&m.admin_url()).unwrap();
    c.batch_execute(OLD_ROW_TRIGGER).unwrap();
    let trigger = |c: &mut MysqlConnection| {
        value(
            c,
            "SELECT COUNT(*) AS v FROM information_schema.TRIGGERS \
             WHERE TRIGGER_SCHEMA = 'dlock' AND TRIGGER_NAME = 'dlock_rows_token'",
        )
    };
    assert_eq!(trigger(&mut c), 1);
    c.batch_execute(
        "INSERT INTO dlock_tokens (lock_key, token) VALUES ('old-trigger-threads', 5); \
         INSERT INTO dlock_rows (lock_key, owner, holder, token, acquired_at) \
           VALUES ('old-trigger-threads', 'old', 'old-holder', 0, UTC_TIMESTAMP(6)); \
         DELETE FROM dlock_rows WHERE lock_key = 'old-trigger-threads'; \
         DELETE FROM __diesel_schema_migrations WHERE version >= '00000000000011'",
    )
    .unwrap();
    let stamped = value(
        &mut c,
        "SELECT token AS v FROM dlock_tokens WHERE lock_key = 'old-trigger-threads'",
    );
    assert_eq!(stamped, 6, "the old trigger stamped the row");
    // The server's messages in another language: the library must not depend on English.
    c.batch_execute("SET GLOBAL lc_messages = 'de_DE'").unwrap();
    let url = app_url(&m);
    locker(&url, Strategy::Row { stale_after: None }, 2)
        .migrate()
        .expect("app migrates a database that has the old trigger, with a binary log");
    // With a binary log, dropping it needs SUPER too: it stays, and stamps Row tokens.
    assert_eq!(
        trigger(&mut c),
        1,
        "the trigger is dropped only where the user may"
    );
    let url = app_url(&m);
    for s in [
        Strategy::Row { stale_after: None },
        Strategy::Row {
            stale_after: Some(Duration::from_secs(60)),
        },
    ] {
        let (a, b) = (locker(&url, s, 4), locker(&url, s, 4));
        a.migrate().unwrap();
        exclusive(&a, &b, "old-trigger");
        // Several threads on one key: per thread, and across the hand-overs, increasing.
        let tokens = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let threads: Vec<_> = (0..3)
            .map(|_| {
                let (l, tokens) = (locker(&url, s, 2), tokens.clone());
                std::thread::spawn(move || {
                    let mut mine = Vec::new();
                    for _ in 0..20 {
                        let g = l.lock("old-trigger-threads").unwrap();
                        // Taken in this order, under the lock: the global order too.
                        tokens.lock().unwrap().push(g.token());
                        mine.push(g.token());
                        g.release().unwrap();
                    }
                    mine
                })
            })
            .collect();
        for t in threads {
            strictly_increasing("one thread", &t.join().unwrap());
        }
        let all = tokens.lock().unwrap().clone();
        strictly_increasing("old-trigger-threads, in hand-over order", &all);
        assert!(
            all[0] > stamped,
            "tokens after the upgrade exceed the trigger's"
        );
        eprintln!(
            "{} with the old trigger: tokens {:?} … {:?}",
            s.name(),
            &all[..3],
            &all[all.len() - 3..]
        );
    }
}

/// What the old migration 1 met: MariaDB refuses a trigger to a user without SUPER while
/// binary logging is on, even with the TRIGGER privilege (`GRANTS` + TRIGGER here).
#[test]
fn the_server_refuses_a_trigger_to_a_user_without_super() {
    let Some(m) = server() else { return };
    let mut admin = MysqlConnection::establish(&m.admin_url()).unwrap();
    admin
        .batch_execute(
            "CREATE USER 'trig'@'%' IDENTIFIED BY 'trig'; \
             GRANT SELECT, INSERT, UPDATE, DELETE, CREATE, ALTER, INDEX, DROP, TRIGGER \
               ON dlock.* TO 'trig'@'%'; \
             CREATE TABLE dlock.dlock_tokens (lock_key VARBINARY(255) PRIMARY KEY, \
               token BIGINT NOT NULL); \
             CREATE TABLE dlock.dlock_rows (id BIGINT AUTO_INCREMENT PRIMARY KEY, \
               lock_key VARBINARY(255) NOT NULL, token BIGINT NOT NULL DEFAULT 0);",
        )
        .unwrap();
    let mut trig = MysqlConnection::establish(&m.url_as("trig", "trig")).unwrap();
    let err = trig
        .batch_execute(OLD_ROW_TRIGGER)
        .expect_err("a trigger without SUPER under a binary log");
    eprintln!("CREATE TRIGGER as a user with TRIGGER but not SUPER: {err}");
    assert!(
        err.to_string()
            .contains("You do not have the SUPER privilege and binary logging is enabled"),
        "{err}"
    );
}

/// A user that never migrates (an admin did): SELECT, INSERT, UPDATE, DELETE are enough for
/// every strategy, mode and cancelled wait.
#[test]
fn a_user_without_ddl_privileges_locks_once_migrated() {
    let Some(m) = server() else { return };
    locker(&m.admin_url(), Strategy::ForUpdate, 2)
        .migrate()
        .unwrap();
    MysqlConnection::establish(&m.admin_url())
        .unwrap()
        .batch_execute(&format!(
            "CREATE USER 'run'@'%' IDENTIFIED BY 'run'; GRANT {RUN_GRANTS} ON dlock.* TO 'run'@'%';"
        ))
        .unwrap();
    every_strategy(&m, "run");
}

/// Where the user may drop it (a server without a binary log, as the shared test server),
/// migration 11 drops the old Row trigger; Row tokens then keep increasing past it.
#[test]
fn the_old_trigger_is_dropped_where_the_user_may() {
    let Some(h) = common::mysql_own_db() else {
        return;
    };
    let l = Locker::builder(h.pool.clone())
        .strategy(Strategy::Row { stale_after: None })
        .build()
        .unwrap();
    l.migrate().unwrap();
    let mut c = h.pool.get().unwrap();
    c.batch_execute(OLD_ROW_TRIGGER).unwrap();
    let before = l.lock("trigger-dropped").unwrap().token();
    c.batch_execute("DELETE FROM __diesel_schema_migrations WHERE version >= '00000000000011'")
        .unwrap();
    l.migrate().unwrap();
    let triggers = value(
        &mut c,
        "SELECT COUNT(*) AS v FROM information_schema.TRIGGERS \
         WHERE TRIGGER_SCHEMA = DATABASE() AND TRIGGER_NAME = 'dlock_rows_token'",
    );
    assert_eq!(triggers, 0, "migration 11 dropped the old trigger");
    let after: Vec<i64> = (0..5)
        .map(|_| l.lock("trigger-dropped").unwrap().token())
        .collect();
    strictly_increasing("after the trigger", &after);
    assert!(after[0] > before);
}
