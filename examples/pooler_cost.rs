//! What a transaction-pooling PgBouncer costs the library, measured in one run: each
//! strategy's cycle (acquire + release, one thread, one key) on PostgreSQL directly with
//! diesel's prepared-statement cache on (the default) and off (what `dlock_pooler=transaction`
//! does), `AdvisoryXact` beside `Advisory` and beside their raw floors (the library's own
//! statements issued through diesel with no library code), and the strategies that work
//! through PgBouncer, through it. Short interleaved rounds, medians (as `bench_report`).
//!
//! ```sh
//! eval "$(bash scripts/services.sh)"
//! cargo run --release --all-features --example pooler_cost
//! ```
//! `DLOCK_BENCH_ROUNDS` (default 7) and `DLOCK_BENCH_ROUND_MS` (default 300) shorten or
//! lengthen it.

#[path = "../benches/support/mod.rs"]
mod support;

use diesel::connection::CacheSize;
use diesel::r2d2::{ConnectionManager, CustomizeConnection, Pool};
use diesel::sql_types::{BigInt, Bool};
use diesel::{Connection, PgConnection, QueryableByName, RunQueryDsl};
use diesel_lock::__bench_sql::pg as lib;
use diesel_lock::{Locker, Strategy};
use std::time::Duration;
use support::raw::pg::Fenced;
use support::sql;

#[derive(Debug, Clone, Copy)]
struct NoCache;

impl CustomizeConnection<PgConnection, diesel::r2d2::Error> for NoCache {
    fn on_acquire(&self, c: &mut PgConnection) -> Result<(), diesel::r2d2::Error> {
        c.set_prepared_statement_cache_size(CacheSize::Disabled);
        Ok(())
    }
}

fn pool(url: &str, cache: bool) -> Pool<ConnectionManager<PgConnection>> {
    let b = Pool::builder()
        .max_size(4)
        .min_idle(Some(0))
        .connection_timeout(Duration::from_secs(30));
    let b = if cache {
        b
    } else {
        b.connection_customizer(Box::new(NoCache))
    };
    b.build(ConnectionManager::new(url)).expect("pool")
}

fn cycle(pool: &Pool<ConnectionManager<PgConnection>>, s: Strategy) -> Box<dyn FnMut()> {
    let l = Locker::builder(pool.clone())
        .strategy(s)
        .owner("bench")
        .build()
        .expect("build");
    l.migrate().expect("migrate");
    let key = support::key(&format!("pooler-{}", s.name()));
    l.lock(&key).expect("lock").release().expect("release");
    Box::new(move || l.lock(&key).expect("lock").release().expect("release"))
}

#[derive(QueryableByName)]
struct Released {
    #[diesel(sql_type = Bool)]
    released: bool,
}

/// Advisory's raw floor: its two statements.
fn raw_advisory(pool: &Pool<ConnectionManager<PgConnection>>) -> Box<dyn FnMut()> {
    let (pool, hash) = (
        pool.clone(),
        diesel_lock::key_hash(&support::key("raw-adv")),
    );
    Box::new(move || {
        let mut c = pool.get().unwrap();
        sql(lib::ADVISORY_LOCK)
            .bind::<BigInt, _>(hash)
            .get_result::<Fenced>(&mut c)
            .expect("lock");
        let r = sql(lib::ADVISORY_UNLOCK)
            .bind::<BigInt, _>(hash)
            .get_result::<Released>(&mut c)
            .expect("unlock");
        assert!(r.released);
    })
}

/// AdvisoryXact's raw floor: BEGIN, its locking statement, COMMIT.
fn raw_advisory_xact(pool: &Pool<ConnectionManager<PgConnection>>) -> Box<dyn FnMut()> {
    let (pool, hash) = (
        pool.clone(),
        diesel_lock::key_hash(&support::key("raw-xact")),
    );
    Box::new(move || {
        let mut c = pool.get().unwrap();
        c.transaction(|c| {
            sql(lib::ADVISORY_XACT_LOCK)
                .bind::<BigInt, _>(hash)
                .get_result::<Fenced>(c)
        })
        .expect("xact lock");
    })
}

fn env_or(var: &str, default: u64) -> u64 {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let direct = std::env::var("DLOCK_TEST_PG_URL").expect("DLOCK_TEST_PG_URL (services.sh)");
    let bouncer = std::env::var("DLOCK_TEST_PGBOUNCER_URL").ok();
    let rounds = env_or("DLOCK_BENCH_ROUNDS", 7) as usize;
    let round = Duration::from_millis(env_or("DLOCK_BENCH_ROUND_MS", 300));
    let strategies = [
        Strategy::Row { stale_after: None },
        Strategy::Lease { ttl: support::TTL },
        Strategy::ForUpdate,
        Strategy::Advisory,
        Strategy::AdvisoryXact,
    ];
    let (cached, uncached) = (pool(&direct, true), pool(&direct, false));
    let mut names = Vec::new();
    let mut contestants: Vec<Box<dyn FnMut()>> = Vec::new();
    for s in strategies {
        names.push(format!("direct, cache on   {}", s.name()));
        contestants.push(cycle(&cached, s));
        names.push(format!("direct, cache off  {}", s.name()));
        contestants.push(cycle(&uncached, s));
    }
    names.push("direct, cache on   raw advisory".into());
    contestants.push(raw_advisory(&cached));
    names.push("direct, cache on   raw advisory-xact".into());
    contestants.push(raw_advisory_xact(&cached));
    if let Some(url) = &bouncer {
        let plain = url
            .replace("?dlock_pooler=transaction", "")
            .replace("&dlock_pooler=transaction", "");
        let through = pool(&plain, false);
        for s in strategies {
            if s != Strategy::Advisory {
                names.push(format!("pgbouncer, cache off {}", s.name()));
                contestants.push(cycle(&through, s));
            }
        }
    }
    let mut refs: Vec<&mut dyn FnMut()> = Vec::new();
    for c in &mut contestants {
        refs.push(c);
    }
    let rates = support::interleaved(round, rounds, &mut refs);
    println!("cycles/s, median of {rounds} interleaved rounds of {round:?}, one thread:");
    for (name, rate) in names.iter().zip(&rates) {
        println!("  {name:<40} {rate:>9.0}");
    }
    let rate = |n: &str| rates[names.iter().position(|x| x == n).unwrap()];
    println!("statement cache off / on (direct):");
    for s in strategies {
        let (on, off) = (
            rate(&format!("direct, cache on   {}", s.name())),
            rate(&format!("direct, cache off  {}", s.name())),
        );
        println!("  {:<14} {:.2}", s.name(), off / on);
    }
    let xact = rate("direct, cache on   advisory-xact");
    println!(
        "advisory-xact / advisory: {:.2}; advisory-xact / its raw floor: {:.2}; advisory / its raw floor: {:.2}",
        xact / rate("direct, cache on   advisory"),
        xact / rate("direct, cache on   raw advisory-xact"),
        rate("direct, cache on   advisory") / rate("direct, cache on   raw advisory"),
    );
}
