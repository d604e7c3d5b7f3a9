//! MariaDB Galera multi-primary (issue 24): a private three-node cluster on loopback
//! (`common::galera`), clients spread over the nodes.
//!
//! - `ForUpdate` and `Advisory` are refused at `build` on a node (their locks hold on one
//!   node only); `Row` and `Lease` build and migrate.
//! - `Row` and `Lease`: mutual exclusion under contention (a deliberately racy
//!   read-sleep-write of a counter row, exact at the end), tokens strictly increasing in
//!   holding order across nodes, a certification failure never reaching the user.
//! - A node SIGKILLed while a client on it holds and others wait on every node.
//! - Handoffs per second across the nodes, beside one plain MariaDB server.
//!
//! Run one at a time (each starts its own cluster): `--test-threads=1`.
#![cfg(feature = "mysql")]

mod common;

use common::galera::{self, Galera};
use common::private_server::PrivateMaria;
use diesel::connection::SimpleConnection;
use diesel::r2d2::{ConnectionManager, Pool};
use diesel::sql_types::{BigInt, Text};
use diesel::{MysqlConnection, QueryableByName, RunQueryDsl};
use diesel_lock::{Error, Locker, Strategy};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

type MyPool = Pool<ConnectionManager<MysqlConnection>>;

const ROW: Strategy = Strategy::Row {
    stale_after: Some(Duration::from_secs(3)),
};
const LEASE: Strategy = Strategy::Lease {
    ttl: Duration::from_secs(3),
};

fn pools(g: &Galera, size: u32) -> Vec<MyPool> {
    (0..g.len())
        .map(|i| common::pool::<MysqlConnection>(&g.url(i), size))
        .collect()
}

fn locker(pool: &MyPool, s: Strategy) -> Locker<MysqlConnection> {
    Locker::builder(pool.clone())
        .strategy(s)
        .max_backoff(Duration::from_millis(20))
        .build()
        .expect("build")
}

#[derive(QueryableByName)]
struct Value {
    #[diesel(sql_type = BigInt)]
    value: i64,
}

/// The cluster's nodes refuse the session strategies at `build`, with the reason; Row and
/// Lease build and migrate.
#[test]
fn session_strategies_are_refused_on_a_node() {
    if !galera::available() {
        return;
    }
    let g = Galera::start();
    let pools = pools(&g, 2);
    for s in [Strategy::ForUpdate, Strategy::Advisory] {
        for (i, pool) in pools.iter().enumerate() {
            match Locker::builder(pool.clone()).strategy(s).build() {
                Err(Error::InvalidConfig(why)) => {
                    assert!(
                        why.contains("Galera") && why.contains("Strategy::Row"),
                        "{why}"
                    );
                    if i == 0 {
                        eprintln!("{}: {}", s.name(), Error::InvalidConfig(why));
                    }
                }
                other => panic!("{} on node {i}: {other:?}", s.name()),
            }
        }
    }
    for s in [ROW, LEASE] {
        let l = locker(&pools[0], s);
        l.migrate().expect("migrate on a Galera node");
        for pool in &pools {
            // A release on one node shows on the next once Galera has applied it there: one
            // attempt could still find the row, so the key gets a moment to show free.
            let g = locker(pool, s)
                .try_lock_for("galera-smoke", Duration::from_secs(5))
                .unwrap()
                .expect("free");
            g.release().unwrap();
        }
    }
    // The connection-level pool `connect` builds is refused the same way.
    let any = diesel_lock::connect(&g.url(1)).unwrap();
    assert!(matches!(
        Locker::builder(any).strategy(Strategy::Advisory).build(),
        Err(Error::InvalidConfig(_))
    ));
}

/// Threads on every node take one key `rounds` times each and do a racy read-sleep-write of
/// a counter row under it (on their own node). Returns the tokens in holding order.
fn racy_counter(pools: &[MyPool], s: Strategy, per_node: usize, rounds: usize) -> Vec<i64> {
    let key = format!("galera-mutex-{}-{}", s.name(), std::process::id());
    pools[0]
        .get()
        .unwrap()
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS dlock_test_counter (name VARCHAR(255) PRIMARY KEY, \
             value BIGINT NOT NULL, last_token BIGINT NOT NULL)",
        )
        .unwrap();
    diesel::sql_query("REPLACE INTO dlock_test_counter (name, value, last_token) VALUES (?, 0, 0)")
        .bind::<Text, _>(&key)
        .execute(&mut pools[0].get().unwrap())
        .unwrap();
    let lockers: Vec<_> = pools.iter().map(|p| locker(p, s)).collect();
    let inside = Arc::new(AtomicUsize::new(0));
    let tokens = Arc::new(Mutex::new(Vec::new()));
    let threads = per_node * pools.len();
    let start = Arc::new(Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let node = t % pools.len();
            let (locker, pool) = (lockers[node].clone(), pools[node].clone());
            let (key, inside, tokens, start) =
                (key.clone(), inside.clone(), tokens.clone(), start.clone());
            std::thread::spawn(move || {
                start.wait();
                for _ in 0..rounds {
                    let g = locker.lock(&key).expect("lock: contention must never be an error");
                    assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0, "two holders at once");
                    tokens.lock().unwrap().push((g.token(), node));
                    {
                        let mut c = pool.get().unwrap();
                        let seen = diesel::sql_query(
                            "SELECT value FROM dlock_test_counter WHERE name = ?",
                        )
                        .bind::<Text, _>(&key)
                        .get_result::<Value>(&mut c)
                        .unwrap()
                        .value;
                        std::thread::sleep(Duration::from_micros(500));
                        diesel::sql_query(
                            "UPDATE dlock_test_counter SET value = ?, last_token = ? WHERE name = ?",
                        )
                        .bind::<BigInt, _>(seen + 1)
                        .bind::<BigInt, _>(g.token())
                        .bind::<Text, _>(&key)
                        .execute(&mut c)
                        .expect("the holder's write (a certification failure here: two writers)");
                    }
                    inside.fetch_sub(1, Ordering::SeqCst);
                    g.release().expect("release");
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    // The last write may not have been applied on node 0 yet: ask with a causal read.
    let mut c = pools[0].get().unwrap();
    c.batch_execute("SET SESSION wsrep_sync_wait = 1").unwrap();
    let count = diesel::sql_query("SELECT value FROM dlock_test_counter WHERE name = ?")
        .bind::<Text, _>(&key)
        .get_result::<Value>(&mut c)
        .unwrap()
        .value;
    assert_eq!(
        count,
        (threads * rounds) as i64,
        "{}: lost updates",
        s.name()
    );
    let tokens = tokens.lock().unwrap().clone();
    let nodes: Vec<usize> = tokens.iter().map(|t| t.1).collect();
    let switches = nodes.windows(2).filter(|w| w[0] != w[1]).count();
    for w in tokens.windows(2) {
        assert!(
            w[0].0 < w[1].0,
            "{}: token {:?} then {:?}",
            s.name(),
            w[0],
            w[1]
        );
    }
    eprintln!(
        "{}: {} acquisitions by {threads} threads on {} nodes, counter {count}, tokens strictly \
         increasing, {switches} handoffs between nodes",
        s.name(),
        tokens.len(),
        pools.len()
    );
    tokens.into_iter().map(|t| t.0).collect()
}

/// Mutual exclusion and tokens across the nodes, Row then Lease.
#[test]
fn row_and_lease_exclude_across_nodes() {
    if !galera::available() {
        return;
    }
    let g = Galera::start();
    let pools = pools(&g, 4);
    locker(&pools[0], ROW).migrate().unwrap();
    let t = Instant::now();
    racy_counter(&pools, Strategy::Row { stale_after: None }, 2, 40);
    eprintln!("row: {:.1} s", t.elapsed().as_secs_f64());
    let t = Instant::now();
    racy_counter(
        &pools,
        Strategy::Lease {
            ttl: Duration::from_secs(10),
        },
        2,
        40,
    );
    eprintln!("lease: {:.1} s", t.elapsed().as_secs_f64());
}

/// A client on node 2 holds the key (Row, stale after 3 s); clients on every node wait for
/// it; node 2 is SIGKILLed. The other two nodes keep quorum, their waiters get the key once
/// it is stale, tokens keep increasing, and the waiter on the dead node never gets it.
#[test]
fn node_killed_while_holding_a_row() {
    if !galera::available() {
        return;
    }
    node_killed(ROW);
}

/// The same for a lease (ttl 3 s): the key is free once the dead holder's lease expired.
#[test]
fn node_killed_while_holding_a_lease() {
    if !galera::available() {
        return;
    }
    node_killed(LEASE);
}

fn node_killed(s: Strategy) {
    let mut g = Galera::start();
    let pools = pools(&g, 4);
    locker(&pools[0], ROW).migrate().unwrap();
    let key = format!("galera-kill-{}", s.name());
    let lockers: Vec<_> = pools.iter().map(|p| locker(p, s)).collect();
    let held = lockers[2].lock(&key).unwrap();
    let first = held.token();
    let results = Arc::new(Mutex::new(Vec::new()));
    let go = Arc::new(AtomicBool::new(false));
    let waiters: Vec<_> = (0..3)
        .map(|node| {
            let (l, key, results, go) = (
                lockers[node].clone(),
                key.clone(),
                results.clone(),
                go.clone(),
            );
            std::thread::spawn(move || {
                let r = l.try_lock_for(&key, Duration::from_secs(15));
                let at = Instant::now();
                let r = match r {
                    Ok(Some(guard)) => {
                        assert!(go.load(Ordering::SeqCst), "acquired before the kill");
                        let t = guard.token();
                        std::thread::sleep(Duration::from_millis(200));
                        drop(guard);
                        Ok(t)
                    }
                    Ok(None) => Err("timed out".to_owned()),
                    Err(e) => Err(e.to_string()),
                };
                results.lock().unwrap().push((node, r, at));
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    go.store(true, Ordering::SeqCst);
    let killed = Instant::now();
    g.kill9(2);
    std::thread::spawn(move || drop(held));
    for w in waiters {
        w.join().unwrap();
    }
    let results = results.lock().unwrap().clone();
    let mut last = first;
    for (node, r, at) in &results {
        eprintln!(
            "{}: waiter on node {node}: {r:?} at {:.2} s after the kill (held before: token {first})",
            s.name(),
            at.duration_since(killed).as_secs_f64()
        );
        if let Ok(t) = r {
            assert_ne!(*node, 2, "the dead node's client acquired");
            assert!(*t > first);
            last = last.max(*t);
        }
    }
    let ok: Vec<_> = results
        .iter()
        .filter(|r| r.1.is_ok())
        .map(|r| r.0)
        .collect();
    assert!(ok.contains(&0) && ok.contains(&1), "{results:?}");
    for i in 0..2 {
        assert_eq!(g.status_of(i, "wsrep_cluster_size").as_deref(), Some("2"));
        assert_eq!(
            g.status_of(i, "wsrep_cluster_status").as_deref(),
            Some("Primary")
        );
    }
    let t = Instant::now();
    for n in 0..20 {
        let guard = lockers[n % 2]
            .try_lock_for(&key, Duration::from_secs(10))
            .unwrap()
            .expect("the survivors go on");
        assert!(guard.token() > last);
        last = guard.token();
    }
    eprintln!(
        "{}: 20 more handoffs between the two survivors in {:.2} s",
        s.name(),
        t.elapsed().as_secs_f64()
    );
}

/// Handoffs per second on one key: 2 threads per node on 3 nodes vs 6 threads on one plain
/// MariaDB server, same run.
#[test]
fn handoffs_per_second_vs_plain() {
    if !galera::available() {
        return;
    }
    let plain = PrivateMaria::start();
    let plain_pool = common::pool::<MysqlConnection>(&plain.url(), 8);
    locker(&plain_pool, ROW).migrate().unwrap();
    let g = Galera::start();
    let pools = pools(&g, 4);
    locker(&pools[0], ROW).migrate().unwrap();
    for s in [
        Strategy::Row { stale_after: None },
        Strategy::Lease {
            ttl: Duration::from_secs(10),
        },
    ] {
        let galera = handoffs(&pools, 2, s);
        let lone = handoffs(std::slice::from_ref(&plain_pool), 6, s);
        eprintln!(
            "{}: handoffs/s: Galera 3 nodes x 2 threads {galera:.0}, plain MariaDB 6 threads {lone:.0}",
            s.name()
        );
    }
}

/// Handoffs per second over 4 s: `per_pool` threads on each pool lock, release, repeat.
fn handoffs(pools: &[MyPool], per_pool: usize, s: Strategy) -> f64 {
    let key = format!("galera-rate-{}-{}", s.name(), pools.len());
    let lockers: Vec<_> = pools.iter().map(|p| locker(p, s)).collect();
    let count = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let handles: Vec<_> = (0..per_pool * pools.len())
        .map(|t| {
            let (l, key, count, stop) = (
                lockers[t % pools.len()].clone(),
                key.clone(),
                count.clone(),
                stop.clone(),
            );
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if let Some(g) = l.try_lock_for(&key, Duration::from_secs(2)).unwrap() {
                        count.fetch_add(1, Ordering::Relaxed);
                        g.release().unwrap();
                    }
                }
            })
        })
        .collect();
    let t = Instant::now();
    std::thread::sleep(Duration::from_secs(4));
    stop.store(true, Ordering::Relaxed);
    let n = count.load(Ordering::Relaxed);
    let secs = t.elapsed().as_secs_f64();
    for h in handles {
        h.join().unwrap();
    }
    n as f64 / secs
}

/// Certification failures and brute-force aborts so far, summed over the running nodes.
fn conflicts(g: &Galera) -> (u64, u64) {
    let mut sum = (0, 0);
    for i in (0..g.len()).filter(|&i| g.is_running(i)) {
        let get = |n| {
            g.status_of(i, n)
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
        };
        sum.0 += get("wsrep_local_cert_failures");
        sum.1 += get("wsrep_local_bf_aborts");
    }
    sum
}

/// An adversary for Row's conditional insert: no waiting line, no look first — every
/// attempt is a `try_lock` (the counter bump, then the insert that checks the counter with a
/// `FOR UPDATE` read, which is local to its node), 3 threads per node for 6 s. Under the
/// lock, the racy counter; tokens in holding order. Any two holders, lost update or token
/// out of order fails.
#[test]
fn row_try_lock_storm() {
    if !galera::available() {
        return;
    }
    let g = Galera::start();
    let pools = pools(&g, 4);
    locker(&pools[0], ROW).migrate().unwrap();
    for s in [
        Strategy::Row { stale_after: None },
        Strategy::Lease {
            ttl: Duration::from_secs(10),
        },
    ] {
        storm(&g, &pools, s);
    }
}

fn storm(g: &Galera, pools: &[MyPool], s: Strategy) {
    let key = format!("galera-storm-{}", s.name());
    pools[0]
        .get()
        .unwrap()
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS dlock_test_counter (name VARCHAR(255) PRIMARY KEY, \
             value BIGINT NOT NULL, last_token BIGINT NOT NULL)",
        )
        .unwrap();
    diesel::sql_query("REPLACE INTO dlock_test_counter (name, value, last_token) VALUES (?, 0, 0)")
        .bind::<Text, _>(&key)
        .execute(&mut pools[0].get().unwrap())
        .unwrap();
    let before = conflicts(g);
    let lockers: Vec<_> = pools.iter().map(|p| locker(p, s)).collect();
    let inside = Arc::new(AtomicUsize::new(0));
    let tokens = Arc::new(Mutex::new(Vec::new()));
    let misses = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let handles: Vec<_> = (0..3 * pools.len())
        .map(|t| {
            let node = t % pools.len();
            let (l, pool) = (lockers[node].clone(), pools[node].clone());
            let (key, inside, tokens, misses, stop) = (
                key.clone(),
                inside.clone(),
                tokens.clone(),
                misses.clone(),
                stop.clone(),
            );
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let Some(g) = l.try_lock(&key).expect("contention must never be an error")
                    else {
                        misses.fetch_add(1, Ordering::Relaxed);
                        continue;
                    };
                    assert_eq!(
                        inside.fetch_add(1, Ordering::SeqCst),
                        0,
                        "two holders at once"
                    );
                    tokens.lock().unwrap().push((g.token(), node));
                    let mut c = pool.get().unwrap();
                    let seen =
                        diesel::sql_query("SELECT value FROM dlock_test_counter WHERE name = ?")
                            .bind::<Text, _>(&key)
                            .get_result::<Value>(&mut c)
                            .unwrap()
                            .value;
                    std::thread::sleep(Duration::from_micros(500));
                    diesel::sql_query("UPDATE dlock_test_counter SET value = ? WHERE name = ?")
                        .bind::<BigInt, _>(seen + 1)
                        .bind::<Text, _>(&key)
                        .execute(&mut c)
                        .expect("the holder's write (a certification failure here: two writers)");
                    drop(c);
                    inside.fetch_sub(1, Ordering::SeqCst);
                    g.release().expect("release");
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_secs(6));
    stop.store(true, Ordering::Relaxed);
    for h in handles {
        h.join().unwrap();
    }
    let after = conflicts(g);
    let mut c = pools[0].get().unwrap();
    c.batch_execute("SET SESSION wsrep_sync_wait = 1").unwrap();
    let count = diesel::sql_query("SELECT value FROM dlock_test_counter WHERE name = ?")
        .bind::<Text, _>(&key)
        .get_result::<Value>(&mut c)
        .unwrap()
        .value;
    let tokens = tokens.lock().unwrap().clone();
    let out_of_order = tokens.windows(2).filter(|w| w[0].0 >= w[1].0).count();
    let switches = tokens.windows(2).filter(|w| w[0].1 != w[1].1).count();
    eprintln!(
        "{} storm: {} acquisitions ({switches} across nodes), {} misses, counter {count}, \
         {out_of_order} tokens out of holding order, cert failures {} bf aborts {}",
        s.name(),
        tokens.len(),
        misses.load(Ordering::Relaxed),
        after.0 - before.0,
        after.1 - before.1
    );
    assert_eq!(count, tokens.len() as i64, "{}: lost updates", s.name());
    assert_eq!(out_of_order, 0, "{}: tokens out of holding order", s.name());
}

/// The line of waiters across nodes: a holder on node 0, then a waiter on node 1, then one on
/// node 2, each joining once the one before has its place (seen from every node, as `dlock
/// list` would show it there); after the release they are served in that order, with
/// increasing tokens. Row and Lease.
#[test]
fn waiters_on_different_nodes_are_served_in_line() {
    if !galera::available() {
        return;
    }
    let g = Galera::start();
    let pools = pools(&g, 4);
    for s in [ROW, LEASE] {
        locker(&pools[0], s).migrate().unwrap();
        let key = format!("galera-line-{}", s.name());
        let holder = locker(&pools[0], s).lock(&key).unwrap();
        // Every node sees `n` waiters: a place is numbered by the node it joins on, above
        // the places that node has applied, so the next waiter's node must have applied
        // the earlier one's place for the line to put it behind (seen once: node 2, still
        // applying node 1's place at load 12-19, numbered its own below it).
        let waiting = |n: u32| {
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                let seen = pools.iter().all(|pool| {
                    let info =
                        diesel_lock::admin::lock_info(&mut *pool.get().unwrap(), &key).unwrap();
                    info.first().is_some_and(|i| i.waiting >= n)
                });
                if seen {
                    return;
                }
                assert!(
                    Instant::now() < deadline,
                    "{}: {n} waiters never showed",
                    s.name()
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        };
        let served = Arc::new(Mutex::new(Vec::new()));
        let mut threads = Vec::new();
        for node in [1, 2] {
            let (pool, key, served) = (pools[node].clone(), key.clone(), served.clone());
            threads.push(std::thread::spawn(move || {
                let l = locker(&pool, s);
                let g = l
                    .try_lock_for(&key, Duration::from_secs(30))
                    .unwrap()
                    .expect("served");
                served
                    .lock()
                    .unwrap()
                    .push((node, g.token(), g.acquired_at().to_rfc3339()));
                std::thread::sleep(Duration::from_millis(50));
                g.release().unwrap();
            }));
            waiting(node as u32);
        }
        // The places as node 0 (the releaser's) sees them: which node joined each, under
        // which number and since when (printed, for a failure to show the line it saw).
        #[derive(QueryableByName)]
        struct Place {
            #[diesel(sql_type = BigInt)]
            id: i64,
            #[diesel(sql_type = Text)]
            owner: String,
            #[diesel(sql_type = Text)]
            since: String,
        }
        let places: Vec<Place> = diesel::sql_query(
            "SELECT id, owner, CAST(since AS CHAR) AS since FROM dlock_waiters \
             WHERE lock_key = ? ORDER BY id",
        )
        .bind::<Text, _>(&key)
        .load(&mut *pools[0].get().unwrap())
        .unwrap();
        let places: Vec<(i64, &str, &str)> = places
            .iter()
            .map(|p| (p.id, p.owner.as_str(), p.since.as_str()))
            .collect();
        eprintln!(
            "{}: places seen from node 0 (id, owner, since): {places:?}",
            s.name()
        );
        let held_token = holder.token();
        eprintln!(
            "{}: holder's token {held_token}, acquired at {}; releasing at {}",
            s.name(),
            holder.acquired_at().to_rfc3339(),
            chrono::Utc::now().to_rfc3339()
        );
        holder.release().unwrap();
        for t in threads {
            t.join().unwrap();
        }
        let served = served.lock().unwrap().clone();
        eprintln!(
            "{}: served (node, token, acquired at): {served:?}",
            s.name()
        );
        assert_eq!(
            served.iter().map(|(n, _, _)| *n).collect::<Vec<_>>(),
            vec![1, 2],
            "{}: served out of line",
            s.name()
        );
        assert!(held_token < served[0].1 && served[0].1 < served[1].1);
    }
}
