//! The library in a dozen lines, on the embedded SQLite default (no server needed):
//! four threads compete for one key; each turn is exclusive and carries a larger token.
//!
//! ```sh
//! cargo run --example quickstart                 # a file quickstart.db in the current directory
//! cargo run --example quickstart --features postgres -- postgres://user:pw@host/db
//! ```

use diesel_lock::{Locker, Strategy};
use std::time::Duration;

fn main() -> diesel_lock::Result<()> {
    let url = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "quickstart.db".into());
    let locker = Locker::connect(&url)?
        .strategy(Strategy::Lease {
            ttl: Duration::from_secs(10),
        })
        .build()?;
    locker.migrate()?;

    let workers: Vec<_> = (0..4)
        .map(|worker| {
            let locker = locker.clone();
            std::thread::spawn(move || -> diesel_lock::Result<()> {
                for _ in 0..3 {
                    let guard = locker.lock("nightly-report")?;
                    println!("worker {worker} holds the lock, token {}", guard.token());
                    std::thread::sleep(Duration::from_millis(20)); // the exclusive work
                    guard.release()?;
                }
                Ok(())
            })
        })
        .collect();
    for worker in workers {
        worker.join().expect("worker panicked")?;
    }

    match locker.try_lock("nightly-report")? {
        Some(guard) => println!("free again: taken with token {}", guard.token()),
        None => println!("still held elsewhere"),
    }
    Ok(())
}
