//! Kinds of lock side by side (the report's "Kinds of lock" table): exclusive `lock`,
//! shared `read` and a semaphore's `permit`, 8 threads on one key, each acquisition held 1 ms.

use super::Db;
use std::time::Duration;

/// A kind of lock for `kinds`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Exclusive,
    Read,
    Permits(u32),
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Exclusive => "exclusive (`lock`)",
            Kind::Read => "shared (`read`)",
            Kind::Permits(_) => "semaphore of 3 (`permit`)",
        }
    }
}

/// The strategies whose kinds are measured on `db`, with the kinds each offers there.
pub fn strategies(db: Db) -> Vec<(diesel_lock::Strategy, Vec<Kind>)> {
    use diesel_lock::Strategy;
    let all = vec![Kind::Exclusive, Kind::Read, Kind::Permits(3)];
    let mut v = vec![(
        Strategy::Lease {
            ttl: Duration::from_secs(10),
        },
        all.clone(),
    )];
    if db != Db::Sqlite {
        v.push((Strategy::ForUpdate, all.clone()));
        v.push((
            Strategy::Advisory,
            if db == Db::Postgres {
                all
            } else {
                // GET_LOCK has no shared mode: neither readers nor permits (which could not
                // keep the key's exclusive lock out).
                vec![Kind::Exclusive]
            },
        ));
    }
    v
}

/// 8 threads, a `Locker` of `strategy` each, on one key for `window`, each acquisition held
/// 1 ms: (acquisitions/s, mean holders at once).
pub fn kinds(db: Db, strategy: diesel_lock::Strategy, kind: Kind, window: Duration) -> (f64, f64) {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::{Arc, Barrier};
    use std::time::Instant;
    let lockers: Vec<_> = (0..8).map(|_| super::locker(db, strategy, 2)).collect();
    let key = super::key("kinds");
    let (start, done) = (Arc::new(Barrier::new(9)), Arc::new(AtomicBool::new(false)));
    let held_ns = Arc::new(AtomicU64::new(0));
    let handles: Vec<_> = lockers
        .into_iter()
        .map(|l| {
            let (key, start, done, held_ns) =
                (key.clone(), start.clone(), done.clone(), held_ns.clone());
            std::thread::spawn(move || {
                start.wait();
                let mut n = 0u64;
                while !done.load(Ordering::Relaxed) {
                    let release = match kind {
                        Kind::Exclusive => l.acquire(&key),
                        Kind::Read => l.acquire_read(&key),
                        Kind::Permits(p) => l.acquire_permit(&key, p),
                    };
                    let t = Instant::now();
                    std::thread::sleep(Duration::from_millis(1));
                    held_ns.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
                    release();
                    n += 1;
                }
                n
            })
        })
        .collect();
    start.wait();
    let t0 = Instant::now();
    std::thread::sleep(window); // the measurement window, not synchronisation
    done.store(true, Ordering::Relaxed);
    let total: u64 = handles.into_iter().map(|h| h.join().unwrap()).sum();
    let elapsed = t0.elapsed().as_secs_f64();
    (
        total as f64 / elapsed,
        held_ns.load(Ordering::Relaxed) as f64 / 1e9 / elapsed,
    )
}
