//! `dlock run --shared`, `--write` and `--semaphore N` on every backend: shared runs overlap
//! and keep a `--write` run and a plain run out (one lock per key); a semaphore of 2 admits two
//! runs and turns a third and a plain run away; `dlock list` shows each holder's mode.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{SystemTime, UNIX_EPOCH};

const DLOCK: &str = env!("CARGO_BIN_EXE_dlock");

fn key(what: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("cli-{what}-{}-{nanos}", std::process::id())
}

fn dlock(url: &str, args: &[&str]) -> Command {
    let mut cmd = Command::new(DLOCK);
    cmd.args(args).env("DLOCK_URL", url).env_remove("RUST_LOG");
    cmd
}

/// A `dlock run` whose command says `started` and then sleeps: returned once it runs.
struct Holder(Child);

impl Holder {
    fn start(url: &str, key: &str, extra: &[&str]) -> Holder {
        let mut args = vec!["run", "--key", key];
        args.extend_from_slice(extra);
        args.extend_from_slice(&["--", "sh", "-c", "echo started; exec sleep 60"]);
        let mut child = dlock(url, &args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "started", "{args:?} did not run");
        Holder(child)
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        // SIGTERM: dlock forwards it to the command, then releases.
        let _ = Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
        let _ = self.0.wait();
    }
}

/// Exit code of one `dlock run … -- true` without waiting.
fn run_once(url: &str, key: &str, extra: &[&str]) -> i32 {
    let mut args = vec!["run", "--key", key];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--", "true"]);
    dlock(url, &args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap()
        .code()
        .unwrap()
}

fn list(url: &str) -> String {
    let out = dlock(url, &["list"]).output().unwrap();
    String::from_utf8(out.stdout).unwrap()
}

fn shared_and_semaphore(url: &str, strategy: &str, shared: bool, semaphores: bool) {
    if shared {
        readers_and_writers(url, strategy);
    }
    if semaphores {
        semaphore(url, strategy);
    }
}

fn readers_and_writers(url: &str, strategy: &str) {
    let k = key("shared");
    let s = ["--strategy", strategy];
    let shared: Vec<&str> = s.iter().copied().chain(["--shared"]).collect();
    let a = Holder::start(url, &k, &shared);
    let b = Holder::start(url, &k, &shared); // a second reader runs beside the first
    let write: Vec<&str> = s.iter().copied().chain(["--write"]).collect();
    assert_eq!(run_once(url, &k, &write), 75, "a writer ran beside readers");
    if strategy == "lease" {
        let listed = list(url);
        let readers = listed.lines().filter(|l| l.contains(&k)).count();
        assert_eq!(readers, 2, "{listed}");
        assert!(listed.lines().next().unwrap().contains("MODE"), "{listed}");
        assert!(
            listed
                .lines()
                .filter(|l| l.contains(&k))
                .all(|l| l.contains(" read ")),
            "{listed}"
        );
    }
    drop(a);
    drop(b);
    assert_eq!(
        run_once(url, &k, &write),
        0,
        "the writer did not run once free"
    );
}

fn semaphore(url: &str, strategy: &str) {
    let s = ["--strategy", strategy];
    let k = key("sem");
    let two: Vec<&str> = s.iter().copied().chain(["--semaphore", "2"]).collect();
    let _p = Holder::start(url, &k, &two);
    let _q = Holder::start(url, &k, &two);
    assert_eq!(run_once(url, &k, &two), 75, "a third holder of 2 permits");
    if strategy == "lease" {
        // (The session strategies' permits are held by sessions, which `list` cannot see.)
        let listed = list(url);
        assert_eq!(
            listed
                .lines()
                .filter(|l| l.contains(&k) && l.contains("permit of 2"))
                .count(),
            2,
            "{listed}"
        );
    }
    // Another number of permits for the key: a usage error, not a silent change.
    let three: Vec<&str> = s.iter().copied().chain(["--semaphore", "3"]).collect();
    assert_ne!(run_once(url, &k, &three), 0);
}

#[test]
fn sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("d.db").display());
    shared_and_semaphore(&url, "lease", true, true);
}

fn server(var: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(u) if !u.is_empty() => Some(u),
        _ => {
            let req = std::env::var("DLOCK_TEST_REQUIRE").unwrap_or_default();
            assert!(!req.contains("all"), "{var} is not set");
            None
        }
    }
}

#[cfg(feature = "postgres")]
#[test]
fn postgres() {
    if let Some(url) = server("DLOCK_TEST_PG_URL") {
        shared_and_semaphore(&url, "lease", true, true);
        shared_and_semaphore(&url, "advisory", true, true);
        shared_and_semaphore(&url, "for-update", true, true);
    }
}

#[cfg(feature = "mysql")]
#[test]
fn mysql() {
    if let Some(url) = server("DLOCK_TEST_MYSQL_URL") {
        shared_and_semaphore(&url, "lease", true, true);
        shared_and_semaphore(&url, "for-update", true, true);
        // GET_LOCK has no shared mode: readers and semaphores are refused as usage errors.
        for kind in [&["--shared"][..], &["--semaphore", "2"][..]] {
            let args: Vec<&str> = ["--strategy", "advisory"]
                .iter()
                .copied()
                .chain(kind.iter().copied())
                .collect();
            assert_eq!(run_once(&url, &key("refused"), &args), 2, "{args:?}");
        }
    }
}

/// One lock per key: a plain `dlock run --key k` is refused beside three `--shared` runs of
/// k, and one that waits runs only once they are gone; likewise beside `--semaphore` runs;
/// and `--shared` on a semaphore's key is an error that says so.
fn exclusive_beside_kinds(url: &str, strategy: &str) {
    let s = ["--strategy", strategy];
    let k = key("one-lock");
    let shared: Vec<&str> = s.iter().copied().chain(["--shared"]).collect();
    let readers: Vec<Holder> = (0..3).map(|_| Holder::start(url, &k, &shared)).collect();
    assert_eq!(
        run_once(url, &k, &s),
        75,
        "{strategy}: a plain run beside 3 readers"
    );
    // A run that waits: its command succeeds only if it starts after the mark, which is
    // made just before the readers end.
    let dir = tempfile::tempdir().unwrap();
    let mark = dir.path().join("readers-gone");
    let check = format!("test -e '{}'", mark.display());
    let mut waiting = dlock(
        url,
        &[
            &["run", "--key", &k, "--wait", "60s"][..],
            &s[..],
            &["--", "sh", "-c", &check][..],
        ]
        .concat(),
    )
    .stdin(Stdio::null())
    .spawn()
    .unwrap();
    // However far the waiting run has got by now, it must not have run.
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert!(
        waiting.try_wait().unwrap().is_none(),
        "{strategy}: ran beside readers"
    );
    std::fs::write(&mark, b"").unwrap();
    drop(readers);
    assert_eq!(
        waiting.wait().unwrap().code(),
        Some(0),
        "{strategy}: the waiting run"
    );
    // Semaphore holders keep a plain run out too.
    let sem = key("one-lock-sem");
    let two: Vec<&str> = s.iter().copied().chain(["--semaphore", "2"]).collect();
    let permits: Vec<Holder> = (0..2).map(|_| Holder::start(url, &sem, &two)).collect();
    assert_eq!(
        run_once(url, &sem, &s),
        75,
        "{strategy}: a plain run beside permits"
    );
    let out = dlock(
        url,
        &[
            &["run", "--key", &sem][..],
            &shared[..],
            &["--", "true"][..],
        ]
        .concat(),
    )
    .stdin(Stdio::null())
    .output()
    .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("semaphore"),
        "{strategy}: {err}"
    );
    drop(permits);
    assert_eq!(
        run_once(url, &sem, &s),
        0,
        "{strategy}: a plain run once free"
    );
}

#[test]
fn sqlite_one_lock() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("d.db").display());
    exclusive_beside_kinds(&url, "lease");
}

#[cfg(feature = "postgres")]
#[test]
fn postgres_one_lock() {
    if let Some(url) = server("DLOCK_TEST_PG_URL") {
        for strategy in ["lease", "for-update", "advisory"] {
            exclusive_beside_kinds(&url, strategy);
        }
    }
}

#[cfg(feature = "mysql")]
#[test]
fn mysql_one_lock() {
    if let Some(url) = server("DLOCK_TEST_MYSQL_URL") {
        for strategy in ["lease", "for-update"] {
            exclusive_beside_kinds(&url, strategy);
        }
    }
}
