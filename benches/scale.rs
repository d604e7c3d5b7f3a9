//! Scale: acquire latency with 10³ and with 10⁶ rows of other keys in the lock tables, for
//! the strategies whose tables grow with the number of keys (`Row`, `Lease`), and the time
//! `Locker::purge` takes to delete 10⁶ rows. Filling 10⁶ rows takes a while (about a minute
//! on MariaDB, whose token trigger runs per row).
//!
//! ```text
//! eval "$(bash scripts/services.sh)"
//! cargo bench --all-features --bench scale
//! ```

mod support;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use std::time::{Duration, Instant};
use support::scale;

fn scale(c: &mut Criterion) {
    for db in support::backends() {
        let lockers: Vec<_> = scale::strategies()
            .into_iter()
            .map(|s| (s, support::locker(db, s, 4)))
            .collect();
        scale::cleanup(db);
        let mut g = c.benchmark_group(format!("scale/{}", db.name()));
        g.throughput(Throughput::Elements(1))
            .sample_size(10)
            .warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_secs(2));
        for digits in [3, 6] {
            let t = Instant::now();
            scale::fill(db, digits);
            println!(
                "{}: filled 10^{digits} rows per table in {:.1?}",
                db.name(),
                t.elapsed()
            );
            for (s, l) in &lockers {
                let key = support::key("scale");
                g.bench_function(format!("{}/acquire-10^{digits}-rows", s.name()), |b| {
                    b.iter_custom(|iters| {
                        scale::acquire_latencies(l, &key, iters as usize)
                            .iter()
                            .sum()
                    })
                });
            }
        }
        g.finish();
        for (s, l) in &lockers {
            let t = Instant::now();
            let n = l.purge(Duration::from_secs(3600));
            println!(
                "{}: {} purge deleted {n} rows in {:.2?}",
                db.name(),
                s.name(),
                t.elapsed()
            );
        }
        scale::cleanup(db);
    }
}

criterion_group!(benches, scale);
criterion_main!(benches);
