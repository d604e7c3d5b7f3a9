//! The first start on an empty database, by many processes at once (the cron case: several
//! machines, the same minute, a new database): 8 `dlock run` processes, and 8 processes that
//! call `Locker::migrate()` then `lock()`, started together against a database with no lock
//! tables, 20 rounds per backend. Every one must succeed or report "held" correctly, and the
//! command (or the critical section) must never run twice at once.
//!
//! Before the fix, a process could see the tables of the first migrations while another was
//! still applying the later ones (MySQL commits each DDL statement at once) and fail with
//! "Unknown column 'holder'", or take a row before the trigger that stamps its token existed.
//!
//! Each round gets an empty database of its own: a temp file for SQLite, a database made for
//! it on the servers (`common::pg_own_db_sized`, `common::mysql_own_db_sized`).
#![cfg(feature = "cli")]

mod common;

use common::conformance::TestDb;
use common::Harness;
use diesel::migration::MigrationSource;
use diesel_lock::{Error, Strategy};
use diesel_migrations::{embed_migrations, EmbeddedMigrations, MigrationHarness};
use std::io::Read;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const DLOCK: &str = env!("CARGO_BIN_EXE_dlock");
const PROCESSES: usize = 8;
const ROUNDS: usize = 20;
/// Longest a round may take before the test fails instead of hanging.
const PATIENCE: Duration = Duration::from_secs(60);

/// The critical section: `mkdir` is atomic, so a second process inside it at the same time
/// fails to make the directory and says so with exit status 99.
fn critical_section(dir: &Path) -> String {
    let held = dir.join("held");
    let held = held.to_str().unwrap();
    let runs = dir.join("runs");
    let runs = runs.to_str().unwrap();
    format!("mkdir {held} || exit 99; echo run >> {runs}; sleep 0.02; rmdir {held}")
}

/// Waits for every child, killing them all if the round outlives `PATIENCE`; returns each
/// one's exit code and stderr.
fn finish_all(children: Vec<Child>) -> Vec<(i32, String)> {
    let started = Instant::now();
    let mut out = Vec::new();
    for mut child in children {
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                let mut err = String::new();
                child
                    .stderr
                    .take()
                    .unwrap()
                    .read_to_string(&mut err)
                    .unwrap();
                out.push((status.code().unwrap_or(-1), err));
                break;
            }
            if started.elapsed() > PATIENCE {
                let _ = child.kill();
                let _ = child.wait();
                panic!("a process was still running after {PATIENCE:?}");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    out
}

fn runs(dir: &Path) -> usize {
    std::fs::read_to_string(dir.join("runs"))
        .map(|s| s.lines().count())
        .unwrap_or(0)
}

/// One round of 8 `dlock run` on the empty database at `url`: each exits 0 (it ran the
/// command) or 75 (held elsewhere), and at least one ran it.
fn dlock_round(url: &str, strategy: &str, round: usize) {
    let dir = tempfile::tempdir().unwrap();
    let script = critical_section(dir.path());
    let key = common::unique_key("first-start");
    let children = (0..PROCESSES)
        .map(|_| {
            Command::new(DLOCK)
                .args(["run", "--key", &key, "--strategy", strategy, "--"])
                .args(["sh", "-c", &script])
                .env("DLOCK_URL", url)
                .env_remove("RUST_LOG")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let results = finish_all(children);
    for (code, err) in &results {
        assert!(
            *code == 0 || *code == 75,
            "round {round} ({strategy}): dlock exited {code}: {err}"
        );
    }
    let ran = results.iter().filter(|(code, _)| *code == 0).count();
    assert!(
        ran >= 1,
        "round {round} ({strategy}): nobody ran the command"
    );
    assert_eq!(
        runs(dir.path()),
        ran,
        "round {round}: runs and exit codes disagree"
    );
}

#[test]
#[ignore = "entry point for the child processes that the library rounds spawn"]
fn child_entry() {
    let Ok(spec) = std::env::var("DLOCK_FIRST_START_CHILD") else {
        return;
    };
    let p: Vec<&str> = spec.split('\t').collect();
    let (backend, url, key, dir) = (p[0], p[1], p[2], Path::new(p[3]));
    match backend {
        "sqlite" => child_main(common::sqlite_at(url, 2), key, dir),
        #[cfg(feature = "postgres")]
        "pg" => child_main(common::server_at::<diesel::PgConnection>(url, 2), key, dir),
        #[cfg(feature = "mysql")]
        "mysql" => child_main(
            common::server_at::<diesel::MysqlConnection>(url, 2),
            key,
            dir,
        ),
        other => panic!("unknown backend {other}"),
    }
}

/// `migrate()` then `lock()`, then the critical section; exits 99 on an overlap.
fn child_main<C: TestDb>(h: Harness<C>, key: &str, dir: &Path) {
    let strategy = Strategy::Row { stale_after: None };
    let locker = h.builder(strategy).build().expect("build");
    locker.migrate().expect("migrate");
    let guard = locker.lock(key).expect("lock");
    let held = dir.join("held");
    if std::fs::create_dir(&held).is_err() {
        std::process::exit(99);
    }
    std::fs::write(dir.join(format!("run-{}", std::process::id())), b"").unwrap();
    std::thread::sleep(Duration::from_millis(5));
    std::fs::remove_dir(&held).unwrap();
    guard.release().expect("release");
}

/// One round of 8 processes calling `migrate()` then `lock()`: all of them get the key,
/// one at a time.
fn library_round(backend: &str, url: &str, round: usize) {
    let dir = tempfile::tempdir().unwrap();
    let key = common::unique_key("first-start-lib");
    let spec = [backend, url, &key, dir.path().to_str().unwrap()].join("\t");
    let children = (0..PROCESSES)
        .map(|_| {
            Command::new(std::env::current_exe().unwrap())
                .args(["--exact", "child_entry", "--ignored", "--nocapture"])
                .env("DLOCK_FIRST_START_CHILD", &spec)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for (code, err) in finish_all(children) {
        assert_eq!(code, 0, "round {round}: a child failed: {err}");
    }
    let ran = std::fs::read_dir(dir.path())
        .unwrap()
        .filter(|e| {
            let name = e.as_ref().unwrap().file_name();
            name.to_str().unwrap().starts_with("run-")
        })
        .count();
    assert_eq!(
        ran, PROCESSES,
        "round {round}: not every process got the key"
    );
}

/// Strategies for round `i`: row (the reported failure) and lease, alternately.
fn strategy(i: usize) -> &'static str {
    ["row", "lease"][i % 2]
}

#[test]
fn sqlite_dlock_run_on_an_empty_database() {
    for round in 0..ROUNDS {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("l.db").display());
        dlock_round(&url, strategy(round), round);
    }
}

#[test]
fn sqlite_migrate_then_lock_on_an_empty_database() {
    for round in 0..ROUNDS {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("l.db");
        library_round("sqlite", path.to_str().unwrap(), round);
    }
}

/// Both rounds on a server, each round on an empty database of its own from `$own_db`
/// (`$backend`: what `child_entry` calls the backend).
macro_rules! server_rounds {
    ($feature:literal, $dlock:ident, $library:ident, $own_db:path, $backend:literal) => {
        #[cfg(feature = $feature)]
        #[test]
        fn $dlock() {
            for round in 0..ROUNDS {
                let Some(db) = $own_db(1) else {
                    return;
                };
                dlock_round(&db.url, strategy(round), round);
            }
        }

        #[cfg(feature = $feature)]
        #[test]
        fn $library() {
            for round in 0..ROUNDS {
                let Some(db) = $own_db(1) else {
                    return;
                };
                library_round($backend, &db.url, round);
            }
        }
    };
}

server_rounds!(
    "postgres",
    postgres_dlock_run_on_an_empty_database,
    postgres_migrate_then_lock_on_an_empty_database,
    common::pg_own_db_sized,
    "pg"
);
server_rounds!(
    "mysql",
    mysql_dlock_run_on_an_empty_database,
    mysql_migrate_then_lock_on_an_empty_database,
    common::mysql_own_db_sized,
    "mysql"
);

// ---------------------------------------------------------------------------------------
// Schema upgrades: a database migrated by an older version (every migration but the newest).

const SQLITE: EmbeddedMigrations = embed_migrations!("migrations/sqlite");
#[cfg(feature = "postgres")]
const POSTGRES: EmbeddedMigrations = embed_migrations!("migrations/postgres");
#[cfg(feature = "mysql")]
const MYSQL: EmbeddedMigrations = embed_migrations!("migrations/mysql");

/// Applies every migration of `source` but the newest, as an older diesel-lock would have.
fn migrate_all_but_the_newest<C>(url: &str, source: EmbeddedMigrations)
where
    C: diesel::Connection + MigrationHarness<C::Backend>,
    EmbeddedMigrations: MigrationSource<C::Backend>,
{
    let mut conn = C::establish(url).unwrap();
    // Creates diesel's record table, as `run_pending_migrations` would.
    assert!(conn.applied_migrations().unwrap().is_empty());
    let all = MigrationSource::<C::Backend>::migrations(&source).unwrap();
    for m in &all[..all.len() - 1] {
        conn.run_migration(&**m).unwrap();
    }
}

/// Applies every migration of `source` but `version`, as a database migrated by a version
/// that had the newer ones and not that one (migration 16 came after 17).
fn migrate_all_but<C>(url: &str, source: EmbeddedMigrations, version: &str)
where
    C: diesel::Connection + MigrationHarness<C::Backend>,
    EmbeddedMigrations: MigrationSource<C::Backend>,
{
    let mut conn = C::establish(url).unwrap();
    assert!(conn.applied_migrations().unwrap().is_empty());
    let all = MigrationSource::<C::Backend>::migrations(&source).unwrap();
    let mut skipped = 0;
    for m in &all {
        if m.name().version().to_string() == version {
            skipped += 1;
            continue;
        }
        conn.run_migration(&**m).unwrap();
    }
    assert_eq!(skipped, 1, "no migration {version}");
}

/// On a database one migration behind: every strategy refuses with `MissingTable`, whose
/// message names `migrate` (before, Lease went on over the old tables and Row failed with
/// the backend's raw "no such column"), and `dlock run` migrates by itself and runs.
fn an_older_schema_is_refused_until_migrated<C: TestDb>(h: &Harness<C>, dlock_url: &str) {
    let lease = Strategy::Lease {
        ttl: Duration::from_secs(30),
    };
    for strategy in [lease, Strategy::Row { stale_after: None }] {
        let locker = h.builder(strategy).build().unwrap();
        match locker.try_lock(&common::unique_key("old-schema")) {
            Err(e @ Error::MissingTable(_)) => {
                assert!(e.to_string().contains("migrate"), "{e}")
            }
            Err(e) => panic!("{strategy:?}: {e:?}"),
            Ok(g) => panic!("{strategy:?} took a lock over the old schema: {g:?}"),
        }
    }
    let out = Command::new(DLOCK)
        .args([
            "run",
            "--key",
            &common::unique_key("old-schema"),
            "--",
            "true",
        ])
        .env("DLOCK_URL", dlock_url)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "dlock run on the old schema: {:?} {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    // Upgraded: a new Locker works without migrating.
    let locker = h.builder(lease).build().unwrap();
    let g = locker.try_lock(&common::unique_key("old-schema")).unwrap();
    assert!(g.is_some());
}

#[test]
fn sqlite_an_older_schema_is_refused_until_migrated() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("l.db");
    let path = path.to_str().unwrap();
    migrate_all_but_the_newest::<diesel::SqliteConnection>(path, SQLITE);
    let h = common::sqlite_at(path, 2);
    an_older_schema_is_refused_until_migrated(&h, &format!("sqlite://{path}"));
}

#[cfg(feature = "postgres")]
#[test]
fn postgres_an_older_schema_is_refused_until_migrated() {
    let Some(h) = common::pg_own_db_sized(2) else {
        return;
    };
    migrate_all_but_the_newest::<diesel::PgConnection>(&h.url, POSTGRES);
    an_older_schema_is_refused_until_migrated(&h, &h.url.clone());
}

#[cfg(feature = "mysql")]
#[test]
fn mysql_an_older_schema_is_refused_until_migrated() {
    let Some(h) = common::mysql_own_db_sized(2) else {
        return;
    };
    migrate_all_but_the_newest::<diesel::MysqlConnection>(&h.url, MYSQL);
    an_older_schema_is_refused_until_migrated(&h, &h.url.clone());
}

/// A database with every migration but 16 (migrated by a version that had 17 and not 16):
/// refused until migrated, as one behind the newest is (before, only the newest was asked
/// for, and `ForUpdate`'s purge failed on its missing `created_at`).
#[cfg(feature = "postgres")]
#[test]
fn postgres_a_gap_below_the_newest_is_refused_until_migrated() {
    let Some(h) = common::pg_own_db_sized(2) else {
        return;
    };
    migrate_all_but::<diesel::PgConnection>(&h.url, POSTGRES, "00000000000016");
    an_older_schema_is_refused_until_migrated(&h, &h.url.clone());
}

#[cfg(feature = "mysql")]
#[test]
fn mysql_a_gap_below_the_newest_is_refused_until_migrated() {
    let Some(h) = common::mysql_own_db_sized(2) else {
        return;
    };
    migrate_all_but::<diesel::MysqlConnection>(&h.url, MYSQL, "00000000000016");
    an_older_schema_is_refused_until_migrated(&h, &h.url.clone());
}
