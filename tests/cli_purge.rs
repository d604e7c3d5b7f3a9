//! `dlock purge`: deletes the rows `dlock run` leaves behind (leases, counters, kinds) once
//! their keys are free, keeps a held key's, honours `--older-than`, says how many rows went,
//! and tokens carry on across it. On a database of the test's own (purge is table-wide).
#![cfg(feature = "cli")]

mod common;

use common::{unique_key, Harness};
use diesel_lock::{LockConnection, Strategy};
use std::process::Command;
use std::time::Duration;

const DLOCK: &str = env!("CARGO_BIN_EXE_dlock");

/// Runs dlock on `url`: its exit code and stdout.
fn dlock(url: &str, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(DLOCK)
        .args(["--url", url])
        .args(args)
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    eprintln!("dlock {args:?} -> {:?}: {stdout}{stderr}", out.status);
    (out.status.code().expect("no signal"), stdout, stderr)
}

/// "deleted N rows …": N.
fn deleted(stdout: &str) -> u64 {
    stdout
        .strip_prefix("deleted ")
        .and_then(|s| s.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("unexpected output {stdout:?}"))
}

fn token(url: &str, args: &[&str]) -> i64 {
    let mut all = vec!["run"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--", "sh", "-c", "echo $DLOCK_TOKEN"]);
    let (code, out, _) = dlock(url, &all);
    assert_eq!(code, 0);
    out.trim().parse().unwrap()
}

fn purge_command<C: LockConnection>(h: &Harness<C>, url: &str) {
    let p = unique_key("clip");
    let (lease, row, shared) = (
        format!("{p}-lease"),
        format!("{p}-row"),
        format!("{p}-shared"),
    );
    let mut last = Vec::new();
    for i in 0..10 {
        last.push(token(url, &["--key", &format!("{lease}-{i}")]));
    }
    let row_token = token(url, &["--strategy", "row", "--key", &row]);
    let shared_token = token(url, &["--shared", "--key", &shared]);
    // Held through the purges: its lease row stays.
    let held = h.locker(Strategy::Lease {
        ttl: Duration::from_secs(30),
    });
    let guard = held.lock(&format!("{p}-held")).unwrap();

    // The leases were released just now: none is an hour old. (The Row key's counter
    // goes whatever --older-than says: it has no age.)
    let (code, out, _) = dlock(url, &["purge", "--older-than", "1h"]);
    assert_eq!(code, 0);
    assert!(deleted(&out) <= 1, "{out}");
    let (code, out, _) = dlock(url, &["purge"]);
    assert_eq!(code, 0);
    // 10 leases, the shared key's lease row and its kind (the Row counter may have gone
    // with the first purge).
    assert!(deleted(&out) >= 12, "{out}");
    let (code, out, _) = dlock(url, &["purge"]);
    assert_eq!(code, 0);
    assert_eq!(out, "deleted 0 rows of keys nobody holds\n");
    guard.check().unwrap();
    // Tokens carry on.
    for (i, before) in last.iter().enumerate() {
        assert!(token(url, &["--key", &format!("{lease}-{i}")]) > *before);
    }
    assert!(token(url, &["--strategy", "row", "--key", &row]) > row_token);
    assert!(token(url, &["--shared", "--key", &shared]) > shared_token);
    guard.release().unwrap();

    // A bad duration: a usage error, one line.
    let (code, out, err) = dlock(url, &["purge", "--older-than", "soon"]);
    assert_eq!(code, 2);
    assert!(out.is_empty());
    assert!(
        err.starts_with("dlock: ") && err.trim_end().lines().count() == 1,
        "{err}"
    );
}

#[test]
fn sqlite_purge_command() {
    let h = common::sqlite().unwrap();
    let url = format!("sqlite://{}", h.url);
    purge_command(&h, &url);
}

#[cfg(feature = "postgres")]
#[test]
fn pg_purge_command() {
    let Some(h) = common::pg_own_db() else { return };
    let url = h.url.clone();
    purge_command(&h, &url);
}

#[cfg(feature = "mysql")]
#[test]
fn mysql_purge_command() {
    let Some(h) = common::mysql_own_db() else {
        return;
    };
    let url = h.url.clone();
    purge_command(&h, &url);
}

#[test]
fn purge_without_tables_deletes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("fresh.db").display());
    let (code, out, _) = dlock(&url, &["purge"]);
    assert_eq!(code, 0);
    assert_eq!(out, "deleted 0 rows of keys nobody holds\n");
}
