//! `dlock run --wait` in the key's line, on every backend (Row and Lease): five runs that
//! start waiting one after the other run their commands in that order, and `dlock list` shows
//! how many wait.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const DLOCK: &str = env!("CARGO_BIN_EXE_dlock");

fn key(what: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("cli-line-{what}-{}-{nanos}", std::process::id())
}

fn dlock(url: &str, args: &[&str]) -> Command {
    let mut cmd = Command::new(DLOCK);
    cmd.args(args).env("DLOCK_URL", url).env_remove("RUST_LOG");
    cmd
}

/// The WAITING column of `dlock list` for `key` (`-` for none).
fn waiting(url: &str, key: &str) -> String {
    let out = dlock(url, &["list"]).output().unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    let header = text.lines().next().unwrap_or_default().to_owned();
    let Some(at) = header.find("WAITING") else {
        return "-".to_owned();
    };
    text.lines()
        .find(|l| l.starts_with(key))
        .map_or("-".to_owned(), |l| {
            l.get(at..)
                .unwrap_or("-")
                .split_whitespace()
                .next()
                .unwrap_or("-")
                .to_owned()
        })
}

fn until_waiting(url: &str, key: &str, n: usize) {
    let start = Instant::now();
    while waiting(url, key) != n.to_string() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "not {n} waiting for {key}: {}",
            waiting(url, key)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn in_order(url: &str, strategy: &str) {
    let key = key(strategy);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("order");
    let file = file.to_str().unwrap();
    // The holder: its command says `started`, then waits for its stdin to close.
    let mut holder = dlock(
        url,
        &[
            "run",
            "--key",
            &key,
            "--strategy",
            strategy,
            "--",
            "sh",
            "-c",
            "echo started; cat >/dev/null",
        ],
    )
    .stdin(Stdio::piped())
    .stdout(Stdio::piped())
    .spawn()
    .unwrap();
    let mut line = String::new();
    BufReader::new(holder.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "started");
    let mut runs: Vec<Child> = Vec::new();
    for i in 0..5 {
        let cmd = format!("echo {i} >> {file}");
        runs.push(
            dlock(
                url,
                &[
                    "run",
                    "--key",
                    &key,
                    "--strategy",
                    strategy,
                    "--wait",
                    "60s",
                    "--",
                    "sh",
                    "-c",
                    &cmd,
                ],
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
        );
        until_waiting(url, &key, i + 1);
    }
    drop(holder.stdin.take());
    assert!(holder.wait().unwrap().success());
    for r in &mut runs {
        assert!(r.wait().unwrap().success());
    }
    let order = std::fs::read_to_string(file).unwrap();
    assert_eq!(
        order.split_whitespace().collect::<Vec<_>>(),
        ["0", "1", "2", "3", "4"],
        "{strategy}"
    );
}

fn server(var: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(u) if !u.is_empty() => Some(u),
        _ => {
            let req = std::env::var("DLOCK_TEST_REQUIRE").unwrap_or_default();
            assert!(
                !req.split([',', ' ']).any(|r| r == "all"),
                "{var} is not set but DLOCK_TEST_REQUIRE=all"
            );
            None
        }
    }
}

#[test]
fn sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("d.db").display());
    in_order(&url, "row");
    in_order(&url, "lease");
}

#[test]
fn postgres() {
    if let Some(url) = server("DLOCK_TEST_PG_URL") {
        in_order(&url, "row");
        in_order(&url, "lease");
    }
}

#[test]
fn mysql() {
    if let Some(url) = server("DLOCK_TEST_MYSQL_URL") {
        in_order(&url, "row");
        in_order(&url, "lease");
    }
}

/// Through a transaction-pooling PgBouncer: no listener there (waiters poll), and `dlock run
/// --wait` works (before, it passed the pooler's URL as `listen_url`, which `build` refuses:
/// every waiting run exited 2).
#[test]
fn pgbouncer() {
    if let Some(url) = server("DLOCK_TEST_PGBOUNCER_URL") {
        in_order(&url, "row");
        in_order(&url, "lease");
    }
}
