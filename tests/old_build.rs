//! An older `dlock` beside this version, on a database it migrated and this version then
//! migrated further (migration 12): the older build must hand out no holder beside this
//! version's, so its `Lease` statements fail (missing tables, in its words) instead of
//! taking an exclusive lease beside readers it cannot see; after migration 14 its
//! `ForUpdate` and `Advisory` permits fail too. Its holders from before the
//! migration keep the key from this version's holders as long as their rows last.
//!
//! Needs the older binary: `DLOCK_OLD_BIN=/path/to/dlock` (built from a commit before
//! migration 12, e.g. fe93c27 into a target directory of its own); skipped with a printed
//! line without it.

mod common;

use common::{unique_key, Harness};
use diesel_lock::{LockConnection, Strategy};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

fn old_bin() -> Option<String> {
    match std::env::var("DLOCK_OLD_BIN") {
        Ok(p) if !p.is_empty() => Some(p),
        _ => {
            eprintln!("skipped: DLOCK_OLD_BIN (an older dlock) is not given");
            None
        }
    }
}

fn old(bin: &str, url: &str, args: &[&str]) -> Command {
    let mut cmd = Command::new(bin);
    cmd.args(args).env("DLOCK_URL", url).env_remove("RUST_LOG");
    cmd.stdin(Stdio::null());
    cmd
}

/// An older `dlock run` holding `key` (its extra options: `--shared`, …) until dropped.
struct OldHolder(Child);

impl OldHolder {
    fn start(bin: &str, url: &str, key: &str, extra: &[&str]) -> OldHolder {
        let args = [
            &["run", "--key", key, "--ttl", "30s"][..],
            extra,
            &["--", "sh", "-c", "echo started; exec sleep 120"][..],
        ]
        .concat();
        let mut child = old(bin, url, &args).stdout(Stdio::piped()).spawn().unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "started", "the older {args:?} did not run");
        OldHolder(child)
    }
}

impl Drop for OldHolder {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// An older `dlock run … -- sh -c 'echo ran'`: its exit code, whether the command ran, and
/// what it printed on stderr.
fn old_run(bin: &str, url: &str, key: &str, extra: &[&str]) -> (Option<i32>, bool, String) {
    let args = [
        &["run", "--key", key][..],
        extra,
        &["--", "sh", "-c", "echo ran"][..],
    ]
    .concat();
    let out = old(bin, url, &args).output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).contains("ran"),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// How the older build reports the tables it no longer finds: as missing tables (asking
/// to migrate), or, for the statements it does not map so, as the database's own error
/// about the column renamed by migration 14 (`dlock_shared_keys.permits`).
fn missing(err: &str) -> bool {
    err.contains("migrate") || (err.contains("column") && err.contains("permits"))
}

fn older_beside_newer<C: LockConnection>(bin: &str, h: &Harness<C>) {
    let url = &h.url;
    let out = old(bin, url, &["migrate"]).output().unwrap();
    assert!(out.status.success(), "older migrate: {out:?}");
    // Holders of the older build, from before the migration.
    let (r, x) = (unique_key("old-reader"), unique_key("old-exclusive"));
    let _reader = OldHolder::start(bin, url, &r, &["--shared"]);
    let _exclusive = OldHolder::start(bin, url, &x, &[]);
    // This version migrates (migration 12) beside them.
    let new = h.locker(Strategy::Lease {
        ttl: Duration::from_secs(10),
    });
    assert!(
        new.try_lock(&r).unwrap().is_none(),
        "an exclusive lease beside an older build's reader"
    );
    assert!(
        new.try_read(&x).unwrap().is_none(),
        "a reader beside an older build's exclusive lease"
    );
    // This version's holders; the older build takes nothing beside them, nor anything new.
    let n = unique_key("new-reader");
    let g = new.try_read(&n).unwrap().expect("a reader");
    let (fresh, fresh_sem) = (unique_key("fresh"), unique_key("fresh-sem"));
    for (key, extra) in [
        (&n, &[][..]),
        (&n, &["--write"][..]),
        (&r, &[][..]),
        (&x, &["--shared"][..]),
        (&fresh, &[][..]),
        (&fresh, &["--shared"][..]),
        (&fresh_sem, &["--semaphore", "2"][..]),
    ] {
        let (code, ran, err) = old_run(bin, url, key, extra);
        eprintln!(
            "older dlock run {extra:?} on {key}: exit {code:?}: {}",
            err.trim()
        );
        assert!(!ran, "the older build ran {extra:?} on {key}");
        // Refused: its statements fail (missing tables), or it finds the key busy before
        // it gets to one that would (an older writer counts this version's reader), never
        // a holder.
        match code {
            Some(1) => assert!(missing(&err), "{err}"),
            Some(75) => assert!(
                key != &fresh && key != &fresh_sem,
                "{extra:?} on a fresh key: busy? {err}"
            ),
            other => panic!("{extra:?} on {key}: exit {other:?}: {err}"),
        }
    }
    drop(g);
}

#[test]
fn sqlite() {
    let Some(bin) = old_bin() else { return };
    let h = common::sqlite().unwrap();
    older_beside_newer(&bin, &h);
}

/// Session strategies (migration 14): an older build's permit does not take its key's own
/// lock in shared mode, so it would run beside this version's exclusive holder of the key.
/// Its permit statements fail instead (`missing`), whether this version holds the key
/// or not. Runs after `older_beside_newer` (which migrated the older build first).
fn older_permits_beside_newer_exclusive<C: LockConnection>(
    bin: &str,
    h: &Harness<C>,
    strategies: &[(&str, Strategy)],
) {
    let url = &h.url;
    for (name, strategy) in strategies {
        let new = h.locker(*strategy);
        let (held, free) = (unique_key("old-permit-held"), unique_key("old-permit-free"));
        let g = new.try_lock(&held).unwrap().expect("a free key");
        for key in [&held, &free] {
            let (code, ran, err) =
                old_run(bin, url, key, &["--strategy", name, "--semaphore", "2"]);
            eprintln!(
                "older dlock run --strategy {name} --semaphore 2 on {key}: exit {code:?}: {}",
                err.trim()
            );
            assert!(!ran, "the older build's {name} permit ran on {key}");
            assert_eq!(code, Some(1), "{name} on {key}: {err}");
            assert!(missing(&err), "{err}");
        }
        drop(g);
    }
}

#[cfg(feature = "postgres")]
#[test]
fn postgres() {
    let Some(bin) = old_bin() else { return };
    if let Some(h) = common::pg_own_db() {
        older_beside_newer(&bin, &h);
        older_permits_beside_newer_exclusive(
            &bin,
            &h,
            &[
                ("for-update", Strategy::ForUpdate),
                ("advisory", Strategy::Advisory),
            ],
        );
    }
}

#[cfg(feature = "mysql")]
#[test]
fn mysql() {
    let Some(bin) = old_bin() else { return };
    if let Some(h) = common::mysql_own_db() {
        older_beside_newer(&bin, &h);
        older_permits_beside_newer_exclusive(&bin, &h, &[("for-update", Strategy::ForUpdate)]);
    }
}
