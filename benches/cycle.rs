//! Cycle cost: one uncontended acquire + release, for every strategy × backend, beside its
//! raw floor (the same statements issued directly through diesel on the same pool), and the
//! Redis `SET NX PX` + Lua compare-and-delete yardstick when `DLOCK_TEST_REDIS_URL` is set.
//!
//! ```text
//! eval "$(bash scripts/services.sh)"
//! cargo bench --all-features --bench cycle
//! ```

mod support;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use std::time::Duration;
use support::{raw, Db};

fn cycle(c: &mut Criterion) {
    for db in support::backends() {
        let mut g = c.benchmark_group(format!("cycle/{}", db.name()));
        g.throughput(Throughput::Elements(1))
            .sample_size(10)
            .warm_up_time(Duration::from_millis(500))
            .measurement_time(Duration::from_secs(2));
        for s in support::strategies(db) {
            let mut p = raw::pair(db, s, &support::key("cycle"));
            g.bench_function(format!("{}/ours", s.name()), |b| b.iter(&mut p.ours));
            g.bench_function(format!("{}/raw", s.name()), |b| b.iter(&mut p.raw));
        }
        g.finish();
    }
    if let Some(redis) = support::Redis::connect() {
        let mut g = c.benchmark_group("cycle/redis");
        g.throughput(Throughput::Elements(1))
            .sample_size(10)
            .warm_up_time(Duration::from_millis(500))
            .measurement_time(Duration::from_secs(2));
        let key = support::key("redis");
        g.bench_function("set-nx-px+lua-del", |b| {
            b.iter(|| redis.cycle(&key, "token"))
        });
        g.finish();
    }
    let _ = Db::Sqlite;
}

criterion_group!(benches, cycle);
criterion_main!(benches);
