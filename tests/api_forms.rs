//! The acquire API's one rule: every kind of lock (`lock`, `read`, `write`, `permit`,
//! `lock_all`) has the same five forms. The forms added to complete it (`try_read_until`,
//! `try_write_until`, `try_permit_until`, `try_lock_all_cancellable`) wait for a busy key
//! until their deadline or cancellation and then take it once it is free, on every backend and
//! every strategy that has the mode; `LockGuard::hold_at_least` keeps the key until its time
//! and gives it up early only on a loss; `Election::run_while_leader` runs the work with a
//! term that ends when the lock is lost.

mod common;

use common::{unique_key, Harness};
use diesel_lock::{admin, Cancel, Election, Error, LockConnection, Locker, Strategy};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const SHORT: Duration = Duration::from_millis(150);

fn lease() -> Strategy {
    Strategy::Lease {
        ttl: Duration::from_secs(10),
    }
}

/// `Ok(None)` at the deadline while `blocker` holds, `Some` once it is gone; `None` as an
/// answer only after the deadline.
fn until_form<C: LockConnection, G>(
    what: &str,
    blocker: G,
    mut attempt: impl FnMut(Instant) -> diesel_lock::Result<Option<diesel_lock::LockGuard<C>>>,
) {
    let t0 = Instant::now();
    let missed = attempt(t0 + SHORT).unwrap();
    assert!(missed.is_none(), "{what}: taken beside its blocker");
    assert!(t0.elapsed() >= SHORT, "{what}: gave up before its deadline");
    drop(blocker);
    let got = attempt(Instant::now() + Duration::from_secs(10)).unwrap();
    assert!(got.is_some(), "{what}: not taken once free");
}

fn until_forms<C: LockConnection>(h: &Harness<C>, strategy: Strategy) {
    let locker = h.locker(strategy);
    let other = h.locker(strategy);
    let k = unique_key("until");
    match other.write(&k) {
        Ok(w) => {
            until_form("try_read_until", w, |d| locker.try_read_until(&k, d));
            let r = other.read(&k).unwrap();
            until_form("try_write_until", r, |d| locker.try_write_until(&k, d));
        }
        Err(Error::Unsupported { .. }) => {
            assert!(matches!(
                locker.try_read_until(&k, Instant::now()),
                Err(Error::Unsupported { .. })
            ));
        }
        Err(e) => panic!("write: {e}"),
    }
    let s = unique_key("until-sem");
    match other.permit(&s, 1) {
        Ok(p) => until_form("try_permit_until", p, |d| locker.try_permit_until(&s, 1, d)),
        Err(Error::Unsupported { .. } | Error::Incompatible { .. }) => {
            assert!(matches!(
                locker.try_permit_until(&s, 1, Instant::now()),
                Err(Error::Unsupported { .. } | Error::Incompatible { .. })
            ));
        }
        Err(e) => panic!("permit: {e}"),
    }
}

/// A `try_lock_all_cancellable` waiting for its second key is cancelled from another thread:
/// it returns `None` and gives back the first key; uncancelled, it takes both.
fn lock_all_cancellable<C: LockConnection>(h: &Harness<C>, strategy: Strategy) {
    let locker = h.locker(strategy);
    let other = h.locker(strategy);
    let (a, b) = (unique_key("all-a"), unique_key("all-b"));
    let held = other.lock(&b).unwrap();
    let cancel = Cancel::new();
    std::thread::scope(|s| {
        let (locker, cancel_w, a2, b2) = (&locker, cancel.clone(), a.clone(), b.clone());
        let wait = s.spawn(move || locker.try_lock_all_cancellable(&[&b2, &a2], None, &cancel_w));
        // Once the waiter holds "a" (keys go in byte order), it is waiting for "b".
        let t0 = Instant::now();
        while other.try_lock(&a).unwrap().is_some() {
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "the waiter never took a"
            );
            std::thread::yield_now();
        }
        cancel.cancel();
        assert!(
            wait.join().unwrap().unwrap().is_none(),
            "a cancelled wait got the locks"
        );
    });
    assert!(
        other.try_lock(&a).unwrap().is_some(),
        "a was not given back"
    );
    drop(held);
    let all = locker
        .try_lock_all_cancellable(
            &[&a, &b],
            Some(Instant::now() + Duration::from_secs(10)),
            &Cancel::new(),
        )
        .unwrap()
        .expect("both free");
    assert_eq!(all.keys().count(), 2);
}

/// The key stays held until `min` after the acquisition, whoever waits for it; a loss ends
/// the hold at once, reported.
fn hold_at_least<C: LockConnection>(h: &Harness<C>, strategy: Strategy) {
    let locker = h.locker(strategy);
    let other = h.locker(strategy);
    let k = unique_key("min-hold");
    let min = Duration::from_millis(600);
    let t0 = Instant::now();
    let guard = locker.lock(&k).unwrap();
    let holder = std::thread::spawn(move || guard.hold_at_least(min));
    let next = other.try_lock_for(&k, Duration::from_secs(30)).unwrap();
    assert!(next.is_some(), "never released");
    assert!(t0.elapsed() >= min, "released after {:?}", t0.elapsed());
    holder.join().unwrap().unwrap();
    drop(next);

    // A lost lock ends the hold early, with the loss.
    let guard = locker.lock(&k).unwrap();
    let (tx, rx) = mpsc::channel();
    let holder = std::thread::spawn(move || tx.send(guard.hold_at_least(Duration::from_secs(120))));
    admin::force_release(&mut *h.pool.get().unwrap(), &k).unwrap();
    let answer = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("hold_at_least went on after the loss");
    assert!(matches!(answer, Err(Error::LockLost { .. })), "{answer:?}");
    holder.join().unwrap().unwrap();
}

/// The work runs with the term of the lock it holds, and sees the term end when the lock is
/// taken away.
fn run_while_leader<C: LockConnection>(h: &Harness<C>, strategy: Strategy) {
    let locker = h.locker(strategy);
    let k = unique_key("leader");
    let election = Election::start(locker, &k).unwrap();
    let pool = h.pool.clone();
    let outcome = election.run_while_leader(Duration::from_secs(30), |term| {
        assert!(term.is_current());
        let held = admin::lock_info(&mut *pool.get().unwrap(), &k).unwrap();
        assert_eq!(held.len(), 1);
        assert_eq!(held[0].token, term.value(), "the term is the lock's token");
        admin::force_release(&mut *pool.get().unwrap(), &k).unwrap();
        (term.wait_ended(Duration::from_secs(60)), term.is_current())
    });
    assert_eq!(outcome, Some((true, false)));
    drop(election);
}

macro_rules! forms {
    ($module:ident, $harness:expr, $strategy:expr) => {
        mod $module {
            use super::*;

            #[test]
            fn until_forms_of_every_mode() {
                if let Some(h) = $harness {
                    until_forms(&h, $strategy);
                }
            }
            #[test]
            fn lock_all_is_cancellable() {
                if let Some(h) = $harness {
                    lock_all_cancellable(&h, $strategy);
                }
            }
        }
    };
}

macro_rules! row_kept {
    ($module:ident, $harness:expr, $strategy:expr) => {
        mod $module {
            use super::*;

            #[test]
            fn hold_at_least_keeps_then_releases() {
                if let Some(h) = $harness {
                    hold_at_least(&h, $strategy);
                }
            }
            #[test]
            fn run_while_leader_sees_the_term_end() {
                if let Some(h) = $harness {
                    run_while_leader(&h, $strategy);
                }
            }
        }
    };
}

fn row() -> Strategy {
    Strategy::Row { stale_after: None }
}

forms!(sqlite_lease, common::sqlite_sized(8), lease());
forms!(sqlite_row, common::sqlite_sized(8), row());
#[cfg(feature = "postgres")]
forms!(pg_lease, common::pg_sized(8), lease());
#[cfg(feature = "postgres")]
forms!(pg_row, common::pg_sized(8), row());
#[cfg(feature = "postgres")]
forms!(pg_advisory, common::pg_sized(8), Strategy::Advisory);
#[cfg(feature = "postgres")]
forms!(pg_for_update, common::pg_sized(8), Strategy::ForUpdate);
#[cfg(feature = "mysql")]
forms!(mysql_lease, common::mysql_sized(8), lease());
#[cfg(feature = "mysql")]
forms!(mysql_row, common::mysql_sized(8), row());
#[cfg(feature = "mysql")]
forms!(mysql_advisory, common::mysql_sized(8), Strategy::Advisory);
#[cfg(feature = "mysql")]
forms!(
    mysql_for_update,
    common::mysql_sized(8),
    Strategy::ForUpdate
);

// hold_at_least and run_while_leader take the lock away with `admin::force_release`, which
// reaches the strategies whose locks are rows (Lease; Row has no elections).
row_kept!(sqlite_lease_kept, common::sqlite_sized(8), lease());
#[cfg(feature = "postgres")]
row_kept!(pg_lease_kept, common::pg_sized(8), lease());
#[cfg(feature = "mysql")]
row_kept!(mysql_lease_kept, common::mysql_sized(8), lease());

/// `hold_at_least` on Row, whose rows `force_release` also removes.
#[test]
fn sqlite_row_hold_at_least() {
    if let Some(h) = common::sqlite_sized(8) {
        hold_at_least(&h, row());
    }
}

/// `Locker` keeps the one rule: the forms compile for every kind (a check of the names).
#[allow(dead_code)]
fn names<C: LockConnection>(l: &Locker<C>, c: &Cancel, t: Instant, d: Duration) {
    let _ = (
        l.try_lock_until("k", t),
        l.try_lock_for("k", d),
        l.try_lock_cancellable("k", Some(t), c),
    );
    let _ = (
        l.try_read_until("k", t),
        l.try_read_for("k", d),
        l.try_read_cancellable("k", Some(t), c),
    );
    let _ = (
        l.try_write_until("k", t),
        l.try_write_for("k", d),
        l.try_write_cancellable("k", Some(t), c),
    );
    let _ = (
        l.try_permit_until("k", 2, t),
        l.try_permit_for("k", 2, d),
        l.try_permit_cancellable("k", 2, Some(t), c),
    );
    let _ = (
        l.try_lock_all_until(&["k"], t),
        l.try_lock_all_for(&["k"], d),
        l.try_lock_all_cancellable(&["k"], Some(t), c),
    );
}
