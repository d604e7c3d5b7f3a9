//! The session strategies' fencing tokens (src/backend/fence.rs) without crashing anything:
//! a token never goes out above the durable bound, a token above the bound the acquiring
//! session knew raises it first, and a new life of the server (what a crash leaves: the
//! UNLOGGED / MEMORY table emptied) starts above the bound. Each test on a database of its
//! own, as they rewrite the tables every session strategy shares. The crashes themselves:
//! tests/server_crash.rs.
#![cfg(any(feature = "postgres", feature = "mysql"))]

mod common;

use common::Harness;
use diesel::connection::SimpleConnection;
use diesel::sql_types::BigInt;
use diesel::{QueryableByName, RunQueryDsl};
use diesel_lock::{LockConnection, Strategy};

/// The strategies with these tokens on the harness's backend (AdvisoryXact: PostgreSQL).
fn session_strategies<C: LockConnection>(h: &Harness<C>) -> Vec<Strategy> {
    let mut v = vec![Strategy::Advisory, Strategy::ForUpdate];
    if h.url.starts_with("postgres") {
        v.push(Strategy::AdvisoryXact);
    }
    v
}

#[derive(QueryableByName)]
struct High {
    #[diesel(sql_type = BigInt)]
    high: i64,
}

/// The bound committed in `dlock_fence`.
trait Bound {
    fn durable_bound(&mut self) -> i64;
}

macro_rules! bound {
    ($conn:ty) => {
        impl Bound for $conn {
            fn durable_bound(&mut self) -> i64 {
                diesel::sql_query("SELECT high FROM dlock_fence WHERE id = 1")
                    .get_result::<High>(self)
                    .unwrap()
                    .high
            }
        }
    };
}
#[cfg(feature = "postgres")]
bound!(diesel::PgConnection);
#[cfg(feature = "mysql")]
bound!(diesel::MysqlConnection);

fn durable_bound<C: LockConnection + Bound>(h: &Harness<C>) -> i64 {
    h.pool.get().unwrap().durable_bound()
}

/// Tokens, several keys, both strategies: each at most the bound committed in `dlock_fence`.
fn tokens_stay_under_the_durable_bound<C: LockConnection + Bound>(h: &Harness<C>) {
    for s in session_strategies(h) {
        let l = h.locker(s);
        for i in 0..20 {
            let g = l.lock(&format!("bound-{}", i % 3)).unwrap();
            let bound = durable_bound(h);
            assert!(
                g.token() <= bound,
                "{}: token {} above the bound {bound}",
                s.name(),
                g.token()
            );
            g.release().unwrap();
        }
    }
}

/// The bound the acquiring session knew is set below the next token (`lower`, on the one
/// connection of `h`'s pool): the acquisition raises the durable bound past its token
/// before handing it out, and tokens keep increasing.
fn a_token_above_the_bound_raises_it<C: LockConnection + Bound>(h: &Harness<C>, lower: &str) {
    for s in session_strategies(h) {
        let l = h.locker(s);
        let first = l.lock("raise").unwrap();
        let t1 = first.token();
        first.release().unwrap();
        h.pool.get().unwrap().batch_execute(lower).unwrap();
        let g = l.lock("raise").unwrap();
        let t2 = g.token();
        g.release().unwrap(); // the pool's one connection, for the next read
        assert!(t2 > t1);
        let bound = durable_bound(h);
        assert!(
            bound >= t2 + (1 << 20),
            "{}: token {t2} went out with the bound at {bound}",
            s.name(),
        );
    }
}

/// A new life of the server, as a crash leaves it (`forget` empties the live table): the
/// next token exceeds the durable bound, hence every token handed out before.
fn a_new_life_starts_above_the_bound<C: LockConnection + Bound>(h: &Harness<C>, forget: &str) {
    for s in session_strategies(h) {
        let l = h.locker(s);
        let before: Vec<i64> = (0..5)
            .map(|_| {
                let g = l.lock("life").unwrap();
                let t = g.token();
                g.release().unwrap();
                t
            })
            .collect();
        let bound = durable_bound(h);
        h.pool.get().unwrap().batch_execute(forget).unwrap();
        let g = l.lock("life").unwrap();
        assert!(
            g.token() > bound && bound >= *before.iter().max().unwrap(),
            "{}: {before:?}, bound {bound}, then {}",
            s.name(),
            g.token()
        );
        g.release().unwrap();
    }
}

#[cfg(feature = "postgres")]
mod pg {
    use super::*;

    #[test]
    fn tokens_stay_under_the_durable_bound() {
        if let Some(h) = common::pg_own_db() {
            super::tokens_stay_under_the_durable_bound(&h);
        }
    }

    #[test]
    fn a_token_above_the_bound_raises_it() {
        if let Some(h) = common::pg_own_db_sized(1) {
            super::a_token_above_the_bound_raises_it(&h, "UPDATE dlock_fence_live SET high = 0");
        }
    }

    #[test]
    fn a_new_life_starts_above_the_bound() {
        if let Some(h) = common::pg_own_db() {
            // What crash recovery does to an UNLOGGED table.
            super::a_new_life_starts_above_the_bound(&h, "TRUNCATE dlock_fence_live");
        }
    }
}

#[cfg(feature = "mysql")]
mod mysql {
    use super::*;

    #[test]
    fn tokens_stay_under_the_durable_bound() {
        if let Some(h) = common::mysql_own_db() {
            super::tokens_stay_under_the_durable_bound(&h);
        }
    }

    #[test]
    fn a_token_above_the_bound_raises_it() {
        // One connection: the bound lowered is the one the acquiring session keeps.
        if let Some(h) = common::mysql_own_db_sized(1) {
            super::a_token_above_the_bound_raises_it(&h, "SET @dlock_fence_high = 0");
        }
    }

    #[test]
    fn a_new_life_starts_above_the_bound() {
        // What a restart does to a MEMORY table, and to every session (its variables).
        if let Some(h) = common::mysql_own_db_sized(1) {
            super::a_new_life_starts_above_the_bound(
                &h,
                "DELETE FROM dlock_fence_live; SET @dlock_fence_off = NULL, @dlock_fence_high = NULL",
            );
        }
    }
}
