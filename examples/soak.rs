//! The long soak: P processes × N acquisitions of one key per backend × strategy, each
//! holder incrementing a racy counter; checks the count, that tokens are unique and increase
//! in the order the holders came, and prints acquisitions/s as a Markdown table.
//!
//! ```text
//! eval "$(bash scripts/services.sh)"   # DLOCK_TEST_PG_URL, DLOCK_TEST_MYSQL_URL
//! cargo run --release --all-features --example soak -- 8 12500 --out docs/soak.md
//! ```
//! Arguments: processes (default 8), acquisitions per process (default 12,500: 10⁵ in all),
//! and `--out FILE` to write the report there as well (`bench_report` carries
//! `docs/soak.md` into BENCHMARKS.md). Backends without a URL are left out (SQLite always
//! runs, in a temp file).

#[path = "../tests/common/soak.rs"]
mod soak;

use std::process::Command;

const USAGE: &str = "usage: soak [PROCESSES] [ACQUISITIONS_PER_PROCESS] [--out FILE]";

fn main() {
    if soak::child() {
        return;
    }
    let mut out = None;
    let mut numbers: Vec<usize> = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        if a == "--out" {
            out = Some(args.next().expect(USAGE));
        } else {
            numbers.push(a.parse().expect(USAGE));
        }
    }
    let processes = numbers.first().copied().unwrap_or(8);
    let acquisitions = numbers.get(1).copied().unwrap_or(12_500);
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
    let mut report = format!(
        "## Soak: {processes} processes × {acquisitions} acquisitions of one key\n\n\
         Produced by `cargo run --release --all-features --example soak -- {processes} \
         {acquisitions} --out docs/soak.md`. Every holder increments a counter file by a read \
         and a write (two holders at once would lose an increment); afterwards the count, the \
         uniqueness of the tokens and their order (by counter value) are checked (a failure shows as FAILED in its row). \
         Longest streak: the most consecutive acquisitions by one \
         process (1: strict alternation).\n\n\
         | backend | strategy | acquisitions | seconds | acquisitions/s | longest streak |\n\
         |---|---|---:|---:|---:|---:|\n"
    );
    print!("{report}");
    let mut failed = false;
    for (name, url, strategies) in &backends {
        for strategy in *strategies {
            let s = soak::Soak {
                url: url.clone(),
                strategy: (*strategy).to_owned(),
                processes,
                acquisitions,
            };
            let line = match soak::run(&s, || Command::new(std::env::current_exe().unwrap())) {
                Ok(o) => format!(
                    "| {name} | {strategy} | {} | {:.1} | {:.0} | {} |\n",
                    o.acquisitions,
                    o.elapsed.as_secs_f64(),
                    o.rate,
                    o.longest_streak
                ),
                Err(e) => {
                    failed = true;
                    format!("| {name} | {strategy} | FAILED: {e} | | | |\n")
                }
            };
            print!("{line}");
            report.push_str(&line);
        }
    }
    if let Some(path) = out {
        std::fs::write(&path, &report).expect("write the report");
    }
    if failed {
        std::process::exit(1);
    }
}
