//! PostgreSQL failover: a private primary and a streaming standby (`common::replica_pg`),
//! clients on a multi-host URL (`target_session_attrs=read-write`) that follows the
//! promotion, and what the locks and their fencing tokens do across it:
//!
//! - an asynchronous standby that lags (its walsender stopped) when the primary crashes and
//!   it is promoted: every token after the promotion exceeds every token seen before, even
//!   those whose commits the standby never received (the token's epoch is the timeline);
//! - a `Row` guard whose row was lost with the lag, after its id was handed out again on the
//!   new primary: the guard reports its lock lost and its release deletes nobody's row;
//! - a synchronous standby: no release and no acquisition is lost, tokens increase;
//! - a clean switchover: tokens increase, never two holders;
//! - a waiter blocked in `lock()` while the primary dies hears the release on the new one
//!   (its `Locker`'s listener reconnects over the multi-host URL).
#![cfg(feature = "postgres")]

mod common;

use common::private_server::available;
use common::replica_pg::{execute, poll_until, query_text, timeline, ReplicaPg, Replication};
use diesel_lock::{Error, LockGuard, Locker, Strategy};
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

type Pg = diesel::PgConnection;

const ROW: Strategy = Strategy::Row { stale_after: None };
const LEASE: Strategy = Strategy::Lease {
    ttl: Duration::from_secs(30),
};

fn locker(url: &str, s: Strategy, owner: &str) -> Locker<Pg> {
    let l = Locker::builder(common::pool::<Pg>(url, 4))
        .strategy(s)
        .owner(owner)
        .build()
        .unwrap();
    l.migrate().unwrap();
    l
}

/// Takes and releases `key` `n` times; the tokens.
fn cycle(l: &Locker<Pg>, key: &str, n: usize) -> Vec<i64> {
    (0..n)
        .map(|_| {
            let g = l.lock(key).unwrap();
            let t = g.token();
            g.release().unwrap();
            t
        })
        .collect()
}

/// Whether `s` keeps its lock in the holder's session (gone with the server).
fn session(s: Strategy) -> bool {
    matches!(s, Strategy::ForUpdate | Strategy::Advisory)
}

fn lost(r: &diesel_lock::Result<()>) -> bool {
    matches!(r, Err(Error::LockLost { .. }))
}

/// Asserts the failover took the test less than a minute.
fn within_a_minute(name: &str, started: Instant) {
    let took = started.elapsed();
    eprintln!("{name}: {:.1} s", took.as_secs_f64());
    assert!(took < Duration::from_secs(60), "{name} took {took:?}");
}

/// Tokens on the old primary, some while the standby lagged behind, a crash, a promotion,
/// tokens on the new primary: all above all before. For the session strategies the
/// primary crashed and restarted once before the lag (so the server life, hence the
/// durable bound, of the lagged tokens is one the standby never heard of); `Row` and
/// `Lease` count per key, which a lag alone sets back.
fn lagging_standby(s: Strategy) {
    if !available("pg") {
        return;
    }
    let name = format!("lagging standby, {}", s.name());
    let started = Instant::now();
    let mut r = ReplicaPg::start(Replication::Async);
    let url = r.multi_host_url();
    let l = locker(&url, s, "lag-a");
    let key = "failover-lag";
    let replicated = cycle(&l, key, 30);
    if session(s) {
        r.crash_primary();
        r.restart_primary();
    }
    // A table of the test's own, to prove the lag: a row committed after the lagged
    // acquisitions must be missing on the new primary.
    execute(&r.primary_url(), "CREATE TABLE failover_mark (n int)");
    r.make_lag();
    let lagged = cycle(&l, key, 30);
    execute(&r.primary_url(), "INSERT INTO failover_mark VALUES (1)");
    let (primary_lsn, replay_lsn) = (r.primary_lsn(), r.standby_replay_lsn());
    r.crash_primary();
    let promoting = r.promote();
    assert_eq!(
        query_text(&r.url(), "SELECT count(*)::text AS v FROM failover_mark")
            .unwrap()
            .as_deref(),
        Some("0"),
        "{name}: the standby did not lag"
    );
    assert_eq!(timeline(&r.url()), 2, "{name}: the new primary's timeline");
    // The same Locker (its pool follows the multi-host URL), and a new one.
    let mut after = cycle(&l, key, 10);
    after.extend(cycle(&locker(&url, s, "lag-b"), key, 10));

    let before: Vec<i64> = replicated.iter().chain(&lagged).copied().collect();
    let before_set: BTreeSet<i64> = before.iter().copied().collect();
    let repeated: Vec<i64> = after
        .iter()
        .copied()
        .filter(|t| before_set.contains(t))
        .collect();
    let max_before = *before.iter().max().unwrap();
    let min_after = *after.iter().min().unwrap();
    eprintln!(
        "{name}: replicated {}..={}, lagged {}..={} (primary at {primary_lsn}, standby at {replay_lsn}), \
         promoted in {:.2} s, after {:?}, repeated {repeated:?}",
        replicated[0],
        replicated.last().unwrap(),
        lagged[0],
        lagged.last().unwrap(),
        promoting.as_secs_f64(),
        after
    );
    assert!(
        min_after > max_before,
        "{name}: token {min_after} after the promotion, {max_before} before it; \
         tokens handed out again: {repeated:?} (lagged tokens {lagged:?})"
    );
    within_a_minute(&name, started);
}

#[test]
fn row_tokens_survive_a_lagging_failover() {
    lagging_standby(ROW);
}

#[test]
fn lease_tokens_survive_a_lagging_failover() {
    lagging_standby(LEASE);
}

#[test]
fn for_update_tokens_survive_a_lagging_failover() {
    lagging_standby(Strategy::ForUpdate);
}

#[test]
fn advisory_tokens_survive_a_lagging_failover() {
    lagging_standby(Strategy::Advisory);
}

/// `key`'s row on the server at `url`: `id holder owner`, or `None`.
fn row_of(url: &str, key: &str) -> Option<String> {
    query_text(
        url,
        &format!(
            "SELECT id || ' ' || holder || ' ' || owner AS v FROM dlock_rows WHERE lock_key = '{key}'"
        ),
    )
    .unwrap()
}

fn row_id(url: &str, key: &str) -> Option<i64> {
    row_of(url, key).map(|r| r.split(' ').next().unwrap().parse().unwrap())
}

/// A takes a `Row` lock while the standby lags; the primary crashes and the standby is
/// promoted without A's row; C takes the key on the new primary in a row with A's id. A's
/// guard must see its lock lost, and its release must leave C's row alone.
#[test]
fn row_guard_never_touches_a_row_that_reused_its_id() {
    if !available("pg") {
        return;
    }
    let name = "row, reused id";
    let started = Instant::now();
    let mut r = ReplicaPg::start(Replication::Async);
    let url = r.multi_host_url();
    let a = locker(&url, ROW, "holder-a");
    let c = locker(&url, ROW, "holder-c");
    let key = "failover-reused-id";
    cycle(&a, key, 5);
    r.make_lag();
    let ga = a.lock(key).unwrap();
    let a_row = row_of(&r.primary_url(), key).expect("A's row");
    let a_id = row_id(&r.primary_url(), key).unwrap();
    r.crash_primary();
    r.promote();
    let new = r.url();
    assert_eq!(
        row_of(&new, key),
        None,
        "{name}: A's row reached the standby despite the lag"
    );

    // C locks the key until its row has A's id: naturally if the standby's identity
    // sequence comes to it, else by restarting the sequence there.
    let mut how = "naturally";
    let mut ids = Vec::new();
    let gc = loop {
        let g = c.lock(key).unwrap();
        let id = row_id(&new, key).expect("C's row");
        ids.push(id);
        if id == a_id {
            break g;
        }
        assert!(ids.len() < 100, "{name}: ids {ids:?} never came to {a_id}");
        g.release().unwrap();
        if id > a_id {
            how = "ALTER TABLE dlock_rows ALTER COLUMN id RESTART WITH (A's id)";
            execute(
                &new,
                &format!("ALTER TABLE dlock_rows ALTER COLUMN id RESTART WITH {a_id}"),
            );
        }
    };
    let c_row = row_of(&new, key).unwrap();
    eprintln!("{name}: A's row {a_row:?} (lost with the lag); C's ids {ids:?} (A's id came {how}); C's row {c_row:?}");

    let a_check = ga.check();
    let a_release = ga.release();
    let row_after = row_of(&new, key);
    let c_check = gc.check();
    let d_try = locker(&new, ROW, "holder-d")
        .try_lock(key)
        .unwrap()
        .map(|g| g.token());
    eprintln!(
        "{name}: A's check {a_check:?}, A's release {a_release:?}; then the row {row_after:?}, \
         C's check {c_check:?}, D's try_lock {d_try:?}"
    );
    assert!(lost(&a_check), "{name}: A's check said {a_check:?}");
    assert!(lost(&a_release), "{name}: A's release said {a_release:?}");
    assert_eq!(
        row_after.as_deref(),
        Some(c_row.as_str()),
        "{name}: A's release touched C's row"
    );
    assert!(c_check.is_ok(), "{name}: C's check said {c_check:?}");
    assert_eq!(d_try, None, "{name}: D took the key C holds");
    gc.release().unwrap();
    within_a_minute(name, started);
}

/// A synchronous standby: a crash of the primary loses no release and no acquisition. A
/// released key is free on the new primary; a key held by `Row` or `Lease` is still held by
/// its holder (and nobody else), one held by a session strategy ended with its session.
/// Tokens increase across.
fn synchronous_standby(s: Strategy) {
    if !available("pg") {
        return;
    }
    let name = format!("synchronous standby, {}", s.name());
    let started = Instant::now();
    let mut r = ReplicaPg::start(Replication::Sync);
    let url = r.multi_host_url();
    let l = locker(&url, s, "sync-a");
    let (released, held) = ("failover-sync-released", "failover-sync-held");
    let before = cycle(&l, released, 20);
    let g = l.lock(held).unwrap();
    let held_token = g.token();
    r.crash_primary();
    r.promote();
    assert_eq!(timeline(&r.url()), 2);
    let other = locker(&url, s, "sync-b");
    // Row and Lease count per key; the session strategies' tokens are global.
    let max_before = *before.iter().max().unwrap();
    let (max_before, max_held) = if session(s) {
        let all = max_before.max(held_token);
        (all, all)
    } else {
        (max_before, held_token)
    };

    // No lost release.
    let free = other.try_lock(released).unwrap();
    let t_free = free.as_ref().map(LockGuard::token);
    drop(free);
    assert!(
        t_free.is_some_and(|t| t > max_before),
        "{name}: the released key gave {t_free:?} on the new primary (tokens before up to {max_before})"
    );
    // No lost acquisition.
    let check = g.check();
    eprintln!(
        "{name}: released key up to {}, then {t_free:?}; held key's token {held_token}, its holder's check {check:?}",
        before.iter().max().unwrap()
    );
    if session(s) {
        assert!(
            lost(&check),
            "{name}: the holder's session died, its check said {check:?}"
        );
        let taken = other.try_lock(held).unwrap().map(|g| g.token());
        assert!(
            taken.is_some_and(|t| t > max_held),
            "{name}: the key of the dead session gave {taken:?} (tokens before up to {max_held})"
        );
        drop(g);
    } else {
        assert!(check.is_ok(), "{name}: the holder's check said {check:?}");
        let taken = other.try_lock(held).unwrap().map(|g| g.token());
        assert_eq!(taken, None, "{name}: a second holder on the new primary");
        g.release().unwrap();
        let taken = other.try_lock(held).unwrap().map(|g| g.token());
        assert!(
            taken.is_some_and(|t| t > max_held),
            "{name}: after the holder's release the key gave {taken:?} (the holder's token {held_token})"
        );
    }
    within_a_minute(&name, started);
}

#[test]
fn row_survives_a_synchronous_failover() {
    synchronous_standby(ROW);
}

#[test]
fn lease_survives_a_synchronous_failover() {
    synchronous_standby(LEASE);
}

#[test]
fn for_update_survives_a_synchronous_failover() {
    synchronous_standby(Strategy::ForUpdate);
}

#[test]
fn advisory_survives_a_synchronous_failover() {
    synchronous_standby(Strategy::Advisory);
}

/// A clean switchover while a key is held and another was released many times: tokens
/// increase, and never two holders (a `Row` or `Lease` holder keeps its lock, a session
/// strategy's holder is told it lost it before anyone else gets it).
fn switchover(s: Strategy) {
    if !available("pg") {
        return;
    }
    let name = format!("switchover, {}", s.name());
    let started = Instant::now();
    let mut r = ReplicaPg::start(Replication::Async);
    let url = r.multi_host_url();
    let l = locker(&url, s, "switch-a");
    let (released, held) = ("failover-switch-released", "failover-switch-held");
    let before = cycle(&l, released, 20);
    let g = l.lock(held).unwrap();
    let held_token = g.token();
    let took = r.switchover();
    assert_eq!(timeline(&r.url()), 2);
    let other = locker(&url, s, "switch-b");
    // Row and Lease count per key; the session strategies' tokens are global.
    let max_before = *before.iter().max().unwrap();
    let (max_before, max_held) = if session(s) {
        let all = max_before.max(held_token);
        (all, all)
    } else {
        (max_before, held_token)
    };

    let mut after = cycle(&l, released, 5);
    after.extend(cycle(&other, released, 5));
    let check = g.check();
    let second = other.try_lock(held).unwrap();
    let second_token = second.as_ref().map(LockGuard::token);
    eprintln!(
        "{name}: switched over in {:.2} s; tokens before up to {max_before}, after {after:?}; \
         the holder's check {check:?}, a second try_lock {second_token:?}",
        took.as_secs_f64()
    );
    let min_after = *after.iter().min().unwrap();
    assert!(
        min_after > max_before,
        "{name}: token {min_after} after the switchover, {max_before} before"
    );
    if session(s) {
        assert!(lost(&check), "{name}: the holder's check said {check:?}");
        assert!(
            second_token.is_some_and(|t| t > max_held),
            "{name}: the key of the ended session gave {second_token:?} (tokens before up to {max_held})"
        );
        drop(g);
    } else {
        assert!(check.is_ok(), "{name}: the holder's check said {check:?}");
        assert_eq!(second_token, None, "{name}: two holders");
        g.release().unwrap();
        let t = other.try_lock(held).unwrap().map(|g| g.token());
        assert!(
            t.is_some_and(|t| t > max_held),
            "{name}: after the release the key gave {t:?} (the holder's token {held_token})"
        );
    }
    drop(second);
    within_a_minute(&name, started);
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

/// Waiters of a `Locker::connect` pool look every 5 to 10 s when nothing wakes them.
const WAITER_BACKOFF: Duration = Duration::from_secs(10);

/// Whether the server at `url` has a `LISTEN`ing session, and a look of the waiter's pool
/// (`application_name` `dlock-waiter`, not LISTEN) that began after it LISTENed.
fn listened_then_looked(url: &str) -> Result<bool, String> {
    let v = query_text(
        url,
        "SELECT (EXISTS (SELECT 1 FROM pg_stat_activity l, pg_stat_activity w \
           WHERE l.query LIKE 'LISTEN%' AND w.pid <> l.pid \
             AND w.application_name = 'dlock-waiter' AND w.query NOT LIKE 'LISTEN%' \
             AND w.state = 'idle' AND w.query_start > l.query_start))::text AS v",
    )?;
    Ok(v.as_deref() == Some("true"))
}

/// A waiter blocked in `lock()` (a `Locker::connect` one: it listens) while the primary
/// crashes and the standby is promoted gets the lock on the new primary as soon as the
/// holder releases it there: its listener reconnected (a LISTEN session on the new primary,
/// waited for) and heard the release. A listening waiter looks only every 5 to 10 s: with
/// its place's channel cleared before the release, it got the lock 4987 ms after it and
/// this test failed. (A waiter whose listener is down polls quickly instead, by design: a
/// listener stuck on the dead primary is caught by the wait for its LISTEN, not by the
/// timing.)
fn listener_follows_the_promotion(s: Strategy) {
    if !available("pg") {
        return;
    }
    let name = format!("listener, {}", s.name());
    let started = Instant::now();
    // Synchronous: the holder's row and the waiter's place are on the standby.
    let mut r = ReplicaPg::start(Replication::Sync);
    let url = r.multi_host_url();
    let holder = locker(&url, s, "listen-holder");
    let key = "failover-listen";
    let g = holder.lock(key).unwrap();
    let held_token = g.token();

    let sep = if url.contains('?') { '&' } else { '?' };
    let waiter = Locker::connect(&format!("{url}{sep}application_name=dlock-waiter"))
        .unwrap()
        .strategy(s)
        .owner("listen-waiter")
        .max_backoff(WAITER_BACKOFF)
        .build()
        .unwrap();
    waiter.migrate().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let waiting = std::thread::spawn(move || {
        let got = waiter.lock(key).map(|g| {
            let at = Instant::now();
            let t = g.token();
            (at, t, g.release())
        });
        tx.send(got).unwrap();
    });
    // The waiter is in line, its place with its listener's channel, and it listens.
    let place = format!(
        "SELECT count(*)::text AS v FROM dlock_waiters WHERE lock_key = '{key}' \
         AND channel IS NOT NULL AND expires_at > now()"
    );
    poll_until(
        "the waiter listens on the primary",
        Duration::from_secs(20),
        || {
            let u = r.primary_url();
            Ok(query_text(&u, &place)?.as_deref() == Some("1") && listened_then_looked(&u)?)
        },
    );
    r.crash_primary();
    r.promote();
    let new = r.url();
    poll_until(
        "the waiter's listener is back on the new primary, and the waiter looked since",
        Duration::from_secs(30),
        || listened_then_looked(&new),
    );
    assert_eq!(
        query_text(&new, &place).unwrap().as_deref(),
        Some("1"),
        "{name}: the waiter's place on the new primary"
    );
    assert!(
        rx.try_recv().is_err(),
        "{name}: the waiter got the lock while it was held"
    );
    let check = g.check();
    assert!(check.is_ok(), "{name}: the holder's check said {check:?}");
    let released_at = Instant::now();
    g.release().unwrap();
    let (at, token, waiter_release) = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("the waiter's lock() returns")
        .expect("the waiter's lock()");
    waiting.join().unwrap();
    let waited = at.saturating_duration_since(released_at);
    eprintln!(
        "{name}: the waiter got token {token} (the holder's {held_token}) {:.0} ms after the release",
        waited.as_secs_f64() * 1000.0
    );
    assert!(
        token > held_token,
        "{name}: token {token} after {held_token}"
    );
    assert!(
        waiter_release.is_ok(),
        "{name}: the waiter's release said {waiter_release:?}"
    );
    assert!(
        waited < Duration::from_secs(2),
        "{name}: the waiter got the lock {waited:?} after the release: it was not woken"
    );
    within_a_minute(&name, started);
}

#[test]
fn row_waiter_listens_on_the_new_primary() {
    listener_follows_the_promotion(ROW);
}

#[test]
fn lease_waiter_listens_on_the_new_primary() {
    listener_follows_the_promotion(LEASE);
}
