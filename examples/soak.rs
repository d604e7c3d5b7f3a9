//! The long soak: P processes × N acquisitions of one key per backend × strategy, each
//! holder incrementing a racy counter; checks the count, that tokens are unique and increase
//! in the order the holders came, and prints acquisitions/s as a Markdown table.
//!
//! ```text
//! eval "$(bash scripts/services.sh)"   # DLOCK_TEST_PG_URL, DLOCK_TEST_MYSQL_URL
//! cargo run --release --all-features --example soak -- 8 12500
//! ```
//! Arguments: processes (default 8), acquisitions per process (default 12,500: 10⁵ in all).
//! Backends without a URL are left out (SQLite always runs, in a temp file).

#[path = "../tests/common/soak.rs"]
mod soak;

use std::process::Command;

fn main() {
    if soak::child() {
        return;
    }
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| {
            a.parse()
                .expect("usage: soak [PROCESSES] [ACQUISITIONS_PER_PROCESS]")
        })
        .collect();
    let processes = args.first().copied().unwrap_or(8);
    let acquisitions = args.get(1).copied().unwrap_or(12_500);
    let dir = tempfile::tempdir().unwrap();
    let mut backends = vec![(
        "SQLite",
        format!("sqlite://{}", dir.path().join("soak.db").display()),
        &["row", "lease"][..],
    )];
    let server = &["row", "lease", "for-update", "advisory"][..];
    for (name, var) in [
        ("PostgreSQL", "DLOCK_TEST_PG_URL"),
        ("MariaDB", "DLOCK_TEST_MYSQL_URL"),
    ] {
        match std::env::var(var) {
            Ok(url) if !url.is_empty() => backends.push((name, url, server)),
            _ => eprintln!("{name} left out: {var} is not set"),
        }
    }
    println!(
        "{processes} processes × {acquisitions} acquisitions of one key, racy counter checked\n"
    );
    println!("| backend | strategy | acquisitions | seconds | acquisitions/s | longest streak |");
    println!("|---|---|---:|---:|---:|---:|");
    let mut failed = false;
    for (name, url, strategies) in &backends {
        for strategy in *strategies {
            let s = soak::Soak {
                url: url.clone(),
                strategy: (*strategy).to_owned(),
                processes,
                acquisitions,
            };
            match soak::run(&s, || Command::new(std::env::current_exe().unwrap())) {
                Ok(o) => println!(
                    "| {name} | {strategy} | {} | {:.1} | {:.0} | {} |",
                    o.acquisitions,
                    o.elapsed.as_secs_f64(),
                    o.rate,
                    o.longest_streak
                ),
                Err(e) => {
                    failed = true;
                    println!("| {name} | {strategy} | FAILED: {e} | | | |");
                }
            }
        }
    }
    if failed {
        std::process::exit(1);
    }
}
