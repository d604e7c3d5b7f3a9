//! The scale report (issue 25): how the cost of holding locks grows with how many one
//! process holds. This file is the minimal driver of the `Advisory` part
//! (`advisory.rs`); the lead merges it with the lease / watcher parts.
//!
//! `cargo run --release --all-features --example scale_report [-- --out FILE]` with
//! `DLOCK_TEST_PG_URL` and/or `DLOCK_TEST_MYSQL_URL` set.

mod advisory;

fn main() {
    advisory::child_if_asked();
    let pg = std::env::var("DLOCK_TEST_PG_URL").ok();
    let mysql = std::env::var("DLOCK_TEST_MYSQL_URL").ok();
    let m = advisory::report(pg.as_deref(), mysql.as_deref());
    print!("{m}");
    let a: Vec<String> = std::env::args().collect();
    if let Some(i) = a.iter().position(|x| x == "--out") {
        std::fs::write(&a[i + 1], &m).unwrap();
    }
}
