//! Fencing tokens and holders across a MariaDB failover (`common::replica_maria`): a private
//! primary and its replica, never the shared servers.
//!
//! - Failover: tokens are drawn on the primary, the replica is made to lag, more tokens are
//!   drawn (which the replica never gets), the primary is SIGKILLed and the replica promoted:
//!   every token drawn on the new primary must exceed every token drawn on the old one, per
//!   key, for Row, Lease, ForUpdate and Advisory (and the readers and permits each has).
//! - A Row holder whose row never reached the replica: after the promotion its guard, whose
//!   connections now lead to the new primary, says lost, and its release deletes nothing of
//!   the row of whoever took the key on the new primary (which may have the same row id).
//! - A clean switchover (the replica caught up, the primary shut down, then promoted): tokens
//!   increase, and a Row or Lease holder of before the switch still holds (nobody else can
//!   take its key) and releases on the new primary.
#![cfg(feature = "mysql")]

mod common;

use common::private_server;
use common::replica_maria::ReplicaPair;
use diesel::MysqlConnection;
use diesel_lock::{Error, LockGuard, Locker, Strategy};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

type Guard = LockGuard<MysqlConnection>;

fn locker(url: &str, s: Strategy) -> Locker<MysqlConnection> {
    Locker::builder(common::pool::<MysqlConnection>(url, 4))
        .strategy(s)
        .build()
        .unwrap()
}

const LEASE: Strategy = Strategy::Lease {
    ttl: Duration::from_secs(30),
};
const ROW: Strategy = Strategy::Row { stale_after: None };

/// Tokens drawn, by key ("k0", "k1": exclusive; "rw": readers; "sem": permits of two).
#[derive(Default)]
struct Drawn(BTreeMap<String, Vec<i64>>);

impl Drawn {
    fn add(&mut self, key: &str, token: i64) {
        self.0.entry(key.to_owned()).or_default().push(token);
    }
}

/// Whether `l` has the mode `try_mode` asks for (else `Error::Unsupported`, or
/// `Error::Incompatible` for `Advisory` permits on MySQL).
fn has_mode(try_mode: diesel_lock::Result<Option<Guard>>) -> bool {
    match try_mode {
        Err(Error::Unsupported { .. } | Error::Incompatible { .. }) => false,
        Ok(Some(g)) => {
            g.release().unwrap();
            true
        }
        other => panic!("probing a mode: {other:?}"),
    }
}

/// `rounds` rounds of: the two exclusive keys, two readers (where the strategy has
/// readers), two permits of two (where it has permits), each taken and released.
fn draw(l: &Locker<MysqlConnection>, rounds: usize, into: &mut Drawn) {
    let readers = has_mode(l.try_read("rw"));
    let permits = has_mode(l.try_permit("sem", 2));
    for _ in 0..rounds {
        for key in ["k0", "k1"] {
            let g = l.lock(key).unwrap();
            into.add(key, g.token());
            g.release().unwrap();
        }
        if readers {
            let (a, b) = (l.read("rw").unwrap(), l.read("rw").unwrap());
            into.add("rw", a.token());
            into.add("rw", b.token());
            drop((a, b));
        }
        if permits {
            let (a, b) = (l.permit("sem", 2).unwrap(), l.permit("sem", 2).unwrap());
            into.add("sem", a.token());
            into.add("sem", b.token());
            drop((a, b));
        }
    }
}

/// `rounds` rounds, each by a new `Locker` (new connections, new sessions).
fn draw_in_new_sessions(url: &str, s: Strategy, rounds: usize, into: &mut Drawn) {
    for _ in 0..rounds {
        draw(&locker(url, s), 1, into);
    }
}

/// Every token after exceeds every token before, key by key; the offending tokens of a key
/// are printed and then make the test fail.
fn after_exceeds_before(name: &str, before: &Drawn, after: &Drawn) {
    let mut bad = Vec::new();
    for (key, after) in &after.0 {
        let Some(before) = before.0.get(key) else {
            continue;
        };
        let max_before = *before.iter().max().unwrap();
        let low: Vec<i64> = after.iter().copied().filter(|t| *t <= max_before).collect();
        let repeated: Vec<i64> = low.iter().copied().filter(|t| before.contains(t)).collect();
        eprintln!(
            "{name} {key}: before {} tokens, {}..={max_before}; after {} tokens, {}..={}",
            before.len(),
            before.iter().min().unwrap(),
            after.len(),
            after.iter().min().unwrap(),
            after.iter().max().unwrap(),
        );
        if !low.is_empty() {
            eprintln!(
                "{name} {key}: {} tokens after the failover <= {max_before}, {} of them \
                 handed out before too: {repeated:?} (all low: {low:?})",
                low.len(),
                repeated.len()
            );
            bad.push(key.clone());
        }
    }
    assert!(
        bad.is_empty(),
        "{name}: tokens after the promotion did not exceed those before, keys {bad:?}"
    );
}

/// Draw, lag, draw, crash, promote, draw on the new primary.
fn failover(s: Strategy) {
    if !private_server::available("mysql") {
        return;
    }
    let started = Instant::now();
    let name = s.name();
    let mut pair = ReplicaPair::start();
    let url = pair.primary_url();
    locker(&url, s).migrate().unwrap();
    let mut before = Drawn::default();
    draw(&locker(&url, s), 10, &mut before);
    draw_in_new_sessions(&url, s, 3, &mut before);
    pair.catch_up();
    pair.make_lag();
    // Never replicated: the same key, and in new sessions too.
    draw(&locker(&url, s), 10, &mut before);
    draw_in_new_sessions(&url, s, 3, &mut before);
    pair.crash_primary();
    pair.promote();
    let new_url = pair.replica_url();
    locker(&new_url, s).migrate().unwrap();
    let mut after = Drawn::default();
    draw(&locker(&new_url, s), 10, &mut after);
    draw_in_new_sessions(&new_url, s, 3, &mut after);
    after_exceeds_before(name, &before, &after);
    eprintln!("{name}: failover test in {:?}", started.elapsed());
}

#[test]
fn row_tokens_after_a_failover_exceed_all_before() {
    failover(ROW);
}

#[test]
fn lease_tokens_after_a_failover_exceed_all_before() {
    failover(LEASE);
}

#[test]
fn for_update_tokens_after_a_failover_exceed_all_before() {
    failover(Strategy::ForUpdate);
}

#[test]
fn advisory_tokens_after_a_failover_exceed_all_before() {
    failover(Strategy::Advisory);
}

/// A Row holder whose row was lost with the primary, its `Locker` reaching the new primary
/// through the proxy: it is told it lost the key, and its release leaves the new holder's
/// row (same key, and possibly the same id: the replica's AUTO_INCREMENT is behind too).
#[test]
fn a_row_lost_in_a_failover_is_lost_and_its_release_spares_the_new_holder() {
    if !private_server::available("mysql") {
        return;
    }
    let started = Instant::now();
    let mut pair = ReplicaPair::start();
    let url = pair.proxy_url();
    let old = locker(&url, ROW);
    old.migrate().unwrap();
    let mut before = Drawn::default();
    for _ in 0..5 {
        let g = old.lock("row-key").unwrap();
        before.add("row-key", g.token());
        g.release().unwrap();
    }
    pair.catch_up();
    pair.make_lag();
    let lost = old.lock("row-key").unwrap();
    before.add("row-key", lost.token());
    lost.check().unwrap();
    pair.crash_primary();
    pair.promote();

    let new = locker(&url, ROW);
    let holder = new
        .try_lock_for("row-key", Duration::from_secs(10))
        .unwrap()
        .expect("the key is free on the new primary: its row never reached it");
    let mut after = Drawn::default();
    after.add("row-key", holder.token());
    let rows = |pair: &ReplicaPair| {
        pair.count_on_replica(
            "SELECT COUNT(*) AS n FROM dlock.dlock_rows WHERE lock_key = 'row-key'",
        )
    };
    assert_eq!(rows(&pair), 1);
    eprintln!(
        "lost holder token {}, new holder token {}; new row id {}",
        lost.token(),
        holder.token(),
        pair.count_on_replica(
            "SELECT CAST(id AS SIGNED) AS n FROM dlock.dlock_rows WHERE lock_key = 'row-key'"
        )
    );
    let check = lost.check();
    eprintln!("the lost holder's check after the promotion: {check:?}");
    let release = lost.release();
    eprintln!("the lost holder's release after the promotion: {release:?}");
    let still = rows(&pair);
    let held = holder.check();
    eprintln!("after it: the new holder's rows {still}, its check {held:?}");
    assert!(
        matches!(check, Err(Error::LockLost { .. })) && still == 1,
        "a holder whose row was lost with the primary was told {check:?}, and its release \
         left {still} rows of the new holder (of 1)"
    );
    held.expect("the new holder still holds");
    assert!(new.try_lock("row-key").unwrap().is_none(), "two holders");
    holder.release().unwrap();
    after_exceeds_before("row (lost holder)", &before, &after);
    eprintln!("lost row test in {:?}", started.elapsed());
}

/// A planned switchover: the replica caught up (`MASTER_GTID_WAIT`), the primary shut down
/// cleanly, the replica promoted, clients through the proxy.
fn switchover(s: Strategy) {
    if !private_server::available("mysql") {
        return;
    }
    let started = Instant::now();
    let name = s.name();
    let mut pair = ReplicaPair::start();
    let url = pair.proxy_url();
    let l = locker(&url, s);
    l.migrate().unwrap();
    let mut before = Drawn::default();
    draw(&l, 10, &mut before);
    draw_in_new_sessions(&url, s, 3, &mut before);
    let kept = l.lock("kept").unwrap();
    before.add("kept", kept.token());
    pair.catch_up();
    pair.stop_primary();
    pair.promote();
    let new = locker(&url, s);
    let mut after = Drawn::default();
    let session = matches!(s, Strategy::ForUpdate | Strategy::Advisory);
    if session {
        // Its session ended with the old primary: lost, and the key is free.
        let check = kept.check();
        assert!(
            matches!(check, Err(Error::LockLost { .. })),
            "{name}: {check:?}"
        );
        drop(kept);
    } else {
        // Its row was replicated: it still holds, alone, and releases on the new primary.
        kept.check()
            .expect("the holder of before the switch still holds");
        assert!(
            new.try_lock("kept").unwrap().is_none(),
            "{name}: two holders"
        );
        kept.release().unwrap();
    }
    let g = new
        .try_lock_for("kept", Duration::from_secs(10))
        .unwrap()
        .expect("free");
    after.add("kept", g.token());
    g.release().unwrap();
    draw(&new, 10, &mut after);
    draw_in_new_sessions(&url, s, 3, &mut after);
    after_exceeds_before(&format!("{name} (switchover)"), &before, &after);
    eprintln!("{name}: switchover test in {:?}", started.elapsed());
}

#[test]
fn row_switchover() {
    switchover(ROW);
}

#[test]
fn lease_switchover() {
    switchover(LEASE);
}

#[test]
fn for_update_switchover() {
    switchover(Strategy::ForUpdate);
}

#[test]
fn advisory_switchover() {
    switchover(Strategy::Advisory);
}
