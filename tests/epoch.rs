//! MySQL's tokens never go below the server's clock (microseconds since 1970, UTC), and the
//! session strategies' token source starts a life of its own on a server that finds another
//! server's life in `dlock_fence_live`: what a replica promoted after it lagged finds. The
//! lagging replica's state is made here directly, in a database of the test's own: counters
//! and the durable bound set back, the old primary's life left in place under another
//! server id with an offset that would hand out old tokens again. Every token after it must
//! exceed every token before. (The real failovers are in tests/failover_*.rs; PostgreSQL's
//! epoch is its timeline, which only a promotion moves.)
#![cfg(feature = "mysql")]

mod common;

use diesel::sql_types::BigInt;
use diesel::{Connection, MysqlConnection, QueryableByName, RunQueryDsl};
use diesel_lock::{Locker, Strategy};
use std::time::Duration;

#[derive(QueryableByName)]
struct Us {
    #[diesel(sql_type = BigInt)]
    us: i64,
}

fn server_clock_us(conn: &mut MysqlConnection) -> i64 {
    diesel::sql_query(
        "SELECT CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) \
         AS SIGNED) AS us",
    )
    .get_result::<Us>(conn)
    .unwrap()
    .us
}

/// Tokens of `rounds` acquisitions of `key`, each released at once.
fn tokens(locker: &Locker<MysqlConnection>, key: &str, rounds: usize) -> Vec<i64> {
    (0..rounds)
        .map(|_| {
            let g = locker.lock(key).unwrap();
            let t = g.token();
            g.release().unwrap();
            t
        })
        .collect()
}

fn strategies() -> [Strategy; 4] {
    [
        Strategy::Row { stale_after: None },
        Strategy::Lease {
            ttl: Duration::from_secs(10),
        },
        Strategy::ForUpdate,
        Strategy::Advisory,
    ]
}

#[test]
fn tokens_start_at_the_server_clock() {
    let Some(h) = common::mysql_own_db() else {
        return;
    };
    // Before the first acquisition in this database: the per-key counters start at the
    // clock of each acquisition, the session strategies' source at the clock of its life's
    // start (from there it counts up by one per token).
    let before = server_clock_us(&mut h.pool.get().unwrap());
    for s in strategies() {
        let locker = h.locker(s);
        let key = common::unique_key("epoch-clock");
        let seen = tokens(&locker, &key, 5);
        assert!(
            seen.iter().all(|t| *t >= before),
            "{s:?}: tokens {seen:?} below the server's clock {before} µs"
        );
        assert!(
            seen.windows(2).all(|w| w[0] < w[1]),
            "{s:?}: tokens {seen:?} do not increase"
        );
        // The readers, writers and permits of a Lease key draw from its own counter.
        if matches!(s, Strategy::Lease { .. }) {
            let k = common::unique_key("epoch-clock-modes");
            let r = locker.read(&k).unwrap();
            assert!(
                r.token() >= before,
                "reader token {} below {before}",
                r.token()
            );
        }
    }
}

#[test]
fn a_promoted_replica_that_lagged_hands_out_larger_tokens() {
    let Some(h) = common::mysql_own_db() else {
        return;
    };
    for s in strategies() {
        let key = common::unique_key("epoch-lag");
        let seen = tokens(&h.locker(s), &key, 20);
        let highest = *seen.iter().max().unwrap();
        {
            // The replica's copy of the tables, behind the old primary by every acquisition
            // above: counters, lease rows and the durable bound set back; the old primary's
            // life replicated under its own server id, with an offset that would repeat
            // tokens on this server's source.
            let mut c = h.pool.get().unwrap();
            for sql in [
                "UPDATE dlock_tokens SET token = 1",
                "UPDATE dlock_leases SET token = 1",
                "UPDATE dlock_fence SET high = 1",
                "UPDATE dlock_fence_live SET server = @@server_id + 1, off = off - 1000000000000",
            ] {
                diesel::sql_query(sql).execute(&mut *c).unwrap();
            }
        }
        // Clients of the new primary: new sessions.
        let after = tokens(
            &Locker::builder(common::pool::<MysqlConnection>(&h.url, 2))
                .strategy(s)
                .build()
                .unwrap(),
            &key,
            20,
        );
        assert!(
            after.iter().all(|t| *t > highest),
            "{s:?}: tokens after the promotion {after:?} do not all exceed the highest before, {highest}"
        );
    }
}

/// A session of an older version, as it drew ForUpdate and Advisory tokens: the life's
/// offset read once into `@dlock_fence_off`, with no server check.
fn old_version_draw(c: &mut MysqlConnection) -> i64 {
    diesel::sql_query(
        "SELECT CAST(CAST(UUID_SHORT() & 72057594037927935 AS SIGNED) + @dlock_fence_off \
         AS SIGNED) AS us",
    )
    .get_result::<Us>(c)
    .unwrap()
    .us
}

/// A rolling upgrade: processes of the older version started the server's life (its row has
/// no server) and keep drawing from it while processes of this version start. This version
/// keeps that life, so tokens from old and new sessions, taken in turn, keep increasing.
#[test]
fn a_life_started_by_an_older_version_is_kept() {
    let Some(h) = common::mysql_own_db() else {
        return;
    };
    let first = h.locker(Strategy::ForUpdate);
    let key = common::unique_key("epoch-upgrade");
    first.lock(&key).unwrap().release().unwrap();
    // The life as an older version leaves it, and one of its sessions.
    let mut old = h.pool.get().unwrap();
    diesel::sql_query("UPDATE dlock_fence_live SET server = NULL")
        .execute(&mut *old)
        .unwrap();
    diesel::sql_query("SET @dlock_fence_off = (SELECT off FROM dlock_fence_live WHERE id = 1)")
        .execute(&mut *old)
        .unwrap();
    // New sessions (a new pool) beside it, in turn with the old session.
    let new = Locker::builder(common::pool::<MysqlConnection>(&h.url, 2))
        .strategy(Strategy::ForUpdate)
        .build()
        .unwrap();
    let mut seen = Vec::new();
    for _ in 0..10 {
        seen.push(old_version_draw(&mut old));
        let g = new.lock(&key).unwrap();
        seen.push(g.token());
        g.release().unwrap();
    }
    assert!(
        seen.windows(2).all(|w| w[0] < w[1]),
        "old and new sessions, in turn: {seen:?}"
    );
}

/// `@@server_id` changed while sessions of the old life run (it is a dynamic setting): new
/// sessions start a life of their own, and a session that joined before draws no token of
/// the replaced life: it joins the new one. Tokens keep increasing across the change.
#[test]
fn a_change_of_server_id_starts_one_life_for_every_session() {
    if !common::private_server::available("mysql") {
        return;
    }
    let m = common::private_server::PrivateMaria::start_configured(&[], &["--server-id=1"]);
    let url = m.url();
    let locker = |size| {
        let l = Locker::builder(common::pool::<MysqlConnection>(&url, size))
            .strategy(Strategy::ForUpdate)
            .build()
            .unwrap();
        l.migrate().unwrap();
        l
    };
    let (a, key) = (locker(1), "epoch-server-id");
    let mut seen = vec![a.lock(key).unwrap().token()];
    diesel::sql_query("SET GLOBAL server_id = 2")
        .execute(&mut MysqlConnection::establish(&url).unwrap())
        .unwrap();
    // A new session starts this server's new life; then the old session draws again.
    let b = locker(1);
    for _ in 0..5 {
        seen.push(b.lock(key).unwrap().token());
        seen.push(a.lock(key).unwrap().token());
    }
    assert!(
        seen.windows(2).all(|w| w[0] < w[1]),
        "tokens across the change of server id: {seen:?}"
    );
}
