//! The scale report (issue 25): what it costs one process to hold many locks, and how the
//! cost grows with their number. A thin dispatcher; each part is a module of its own
//! (`lease.rs`: `Lease` locks with a loss watch on each guard; `advisory.rs`: `Advisory`
//! locks on the shared sessions, PostgreSQL and MariaDB at once, `--part advisory`;
//! `others.rs`: `Row`, `ForUpdate` and `AdvisoryXact`, and what each backend refuses,
//! `--part others`, each N measured in a child process of its own).
//!
//! ```text
//! cargo run --release --all-features --example scale_report -- \
//!     --backend pg --url postgres://… --n 10,1000,10000 [--ttl 30] [--kind read] \
//!     [--out docs/scale.md]
//! ```
//! `--backend` is `sqlite` (`--url` a file path), `pg` or `mysql`. `--kind read`: the lease
//! part holds N readers (`Locker::read`, one per key) instead of N exclusive leases.
//! `--part others` takes `--backend`, `--url` and `--n` (the `Row` sizes; `ForUpdate` and
//! `AdvisoryXact` are measured at fixed sizes on a pool of their size). The markdown table
//! goes to stdout, or is appended to `--out`.

mod advisory;
mod lease;
mod others;

use std::time::Duration;

/// The command line, parsed by hand (no dependency for four flags).
pub(crate) struct Args {
    pub(crate) backend: String,
    pub(crate) url: String,
    pub(crate) n: Vec<usize>,
    pub(crate) ttl: Duration,
    pub(crate) out: Option<String>,
    pub(crate) part: String,
    /// `lock` (exclusive leases) or `read` (readers), for the lease part.
    pub(crate) kind: String,
}

fn args() -> Args {
    let mut a = Args {
        backend: "sqlite".into(),
        url: String::new(),
        n: vec![10, 1000, 10_000],
        ttl: Duration::from_secs(30),
        out: None,
        part: "lease".into(),
        kind: "lock".into(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--backend" => a.backend = value(),
            "--url" => a.url = value(),
            "--n" => {
                a.n = value()
                    .split(',')
                    .map(|n| n.parse().expect("--n"))
                    .collect()
            }
            "--ttl" => a.ttl = Duration::from_secs(value().parse().expect("--ttl")),
            "--out" => a.out = Some(value()),
            "--part" => a.part = value(),
            "--kind" => a.kind = value(),
            other => panic!("unknown flag {other}"),
        }
    }
    if a.url.is_empty() {
        a.url = match a.backend.as_str() {
            "sqlite" => std::env::temp_dir()
                .join("dlock-scale.db")
                .to_string_lossy()
                .into_owned(),
            "pg" => std::env::var("DLOCK_TEST_PG_URL").expect("--url or DLOCK_TEST_PG_URL"),
            "mysql" => {
                std::env::var("DLOCK_TEST_MYSQL_URL").expect("--url or DLOCK_TEST_MYSQL_URL")
            }
            other => panic!("unknown backend {other}"),
        };
    }
    a
}

fn main() {
    // A child that holds leases until it is killed (the SIGKILL measurement).
    if let Ok(spec) = std::env::var("DLOCK_SCALE_CHILD") {
        return lease::child(&spec);
    }
    // Every connection opened from here on counts its statements (the others part).
    others::count_statements();
    if let Ok(spec) = std::env::var("DLOCK_SCALE_OTHERS_CHILD") {
        return others::child(&spec);
    }
    advisory::child_if_asked();
    let a = args();
    if let Ok(spec) = std::env::var("DLOCK_SCALE_OTHERS_MEASURE") {
        return others::measure_child(&a, &spec);
    }
    let report = match a.part.as_str() {
        "lease" => lease::report(&a),
        // The Advisory part takes its URLs from DLOCK_TEST_PG_URL / DLOCK_TEST_MYSQL_URL.
        "advisory" => advisory::report(
            std::env::var("DLOCK_TEST_PG_URL").ok().as_deref(),
            std::env::var("DLOCK_TEST_MYSQL_URL").ok().as_deref(),
        ),
        "others" => others::report(&a),
        other => panic!("unknown part {other}"),
    };
    match &a.out {
        Some(path) => {
            use std::io::Write;
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .unwrap();
            f.write_all(report.as_bytes()).unwrap();
        }
        None => print!("{report}"),
    }
}
