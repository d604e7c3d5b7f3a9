//! The library's metrics (feature `metrics`), printed: a few acquisitions, contention, a
//! loss and releases on SQLite in a temporary file, recorded by metrics-util's
//! `DebuggingRecorder`. In a service, install the recorder you export with instead (e.g.
//! `metrics-exporter-prometheus`): the library only talks to the `metrics` facade.
//!
//! ```text
//! cargo run --example metrics --features metrics
//! ```

use diesel_lock::{admin, connect, Locker, Strategy};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use std::time::Duration;

fn main() -> diesel_lock::Result<()> {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder.install().expect("no other recorder");

    let dir = tempfile::tempdir().expect("a temporary directory");
    let pool = connect(dir.path().join("metrics.db").to_str().expect("utf-8"))?;
    let locker = Locker::builder(pool.clone())
        .strategy(Strategy::Lease {
            ttl: Duration::from_secs(3),
        })
        .build()?;
    locker.migrate()?;

    for _ in 0..5 {
        locker.lock("report")?.release()?; // five acquisitions, held briefly
    }
    let held = locker.lock("report")?;
    let other = Locker::builder(pool.clone())
        .strategy(locker.strategy())
        .build()?;
    assert!(other
        .try_lock_for("report", Duration::from_millis(100))?
        .is_none()); // contended
    admin::force_release(&mut *pool.get()?, "report")?; // taken away: a loss
    assert!(held.wait_lost(Duration::from_secs(5)));
    drop(held);

    let mut lines: Vec<String> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .map(|(key, _, _, value)| {
            let labels: Vec<String> = key
                .key()
                .labels()
                .map(|l| format!("{}={:?}", l.key(), l.value()))
                .collect();
            let value = match value {
                DebugValue::Counter(c) => c.to_string(),
                DebugValue::Gauge(g) => g.to_string(),
                DebugValue::Histogram(h) => {
                    let sum: f64 = h.iter().map(|v| v.into_inner()).sum();
                    format!("{} values, sum {sum:.6} s", h.len())
                }
            };
            format!("{}{{{}}} {value}", key.key().name(), labels.join(","))
        })
        .collect();
    lines.sort();
    for line in lines {
        println!("{line}");
    }
    Ok(())
}
