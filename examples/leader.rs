//! Leader election across processes: three replicas campaign for "scheduler"; the leader is
//! killed (SIGKILL); a new one takes over within ttl + 1 s, with a greater term.
//!
//! ```text
//! cargo run --example leader                       # SQLite, in a temporary file
//! cargo run --example leader --features postgres -- postgres://user@localhost/db
//! ```
//!
//! Run without `replica`, it starts three replicas of itself (`leader replica URL`), and
//! reports. A replica prints `LEADER <term>` when elected and `DEPOSED <term>` when it loses
//! the lock, and "runs the scheduler" (prints a tick) while it leads.

use diesel_lock::{Election, Leadership, Locker, Strategy};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const TTL: Duration = Duration::from_secs(2);

fn replica(url: &str) -> diesel_lock::Result<()> {
    let locker = Locker::connect(url)?
        .strategy(Strategy::Lease { ttl: TTL })
        .build()?;
    locker.migrate()?;
    let election = Election::start(locker, "scheduler")?;
    for event in election.subscribe() {
        match event {
            Leadership::Elected { term } => println!("LEADER {term}"),
            Leadership::Deposed { term } => println!("DEPOSED {term}"),
            _ => {}
        }
    }
    Ok(())
}

fn spawn(i: usize, url: &str, tx: mpsc::Sender<(usize, String, Instant)>) -> Child {
    let mut child = Command::new(std::env::current_exe().expect("own path"))
        .args(["replica", url])
        .stdout(Stdio::piped())
        .spawn()
        .expect("start a replica");
    let out = BufReader::new(child.stdout.take().expect("stdout"));
    std::thread::spawn(move || {
        for line in out.lines().map_while(Result::ok) {
            let _ = tx.send((i, line, Instant::now()));
        }
    });
    child
}

fn next_leader(rx: &mpsc::Receiver<(usize, String, Instant)>) -> (usize, i64, Instant) {
    loop {
        let (i, line, at) = rx
            .recv_timeout(TTL + Duration::from_secs(10))
            .expect("no leader");
        if let Some(term) = line.strip_prefix("LEADER ") {
            return (i, term.parse().expect("a term"), at);
        }
    }
}

fn main() -> diesel_lock::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("replica") {
        return replica(&args[2]);
    }
    let dir = tempfile::tempdir().expect("a temporary directory");
    let url = match args.get(1) {
        Some(url) => url.clone(),
        None => dir
            .path()
            .join("leader.db")
            .to_str()
            .expect("utf-8")
            .to_owned(),
    };
    // Create the tables once, before the replicas race to.
    Locker::connect(&url)?.build()?.migrate()?;
    let (tx, rx) = mpsc::channel();
    let mut replicas: Vec<Child> = (0..3).map(|i| spawn(i, &url, tx.clone())).collect();
    let (leader, term, _) = next_leader(&rx);
    println!("replica {leader} leads, term {term}");
    std::thread::sleep(Duration::from_secs(1));
    replicas[leader].kill().expect("kill"); // SIGKILL: no release, no more renewals
    let killed = Instant::now();
    replicas[leader].wait().expect("reap");
    println!("replica {leader} killed");
    let (next, next_term, at) = next_leader(&rx);
    let took = at.saturating_duration_since(killed);
    println!("replica {next} leads, term {next_term}, {took:?} after the kill (ttl {TTL:?})");
    assert_ne!(next, leader);
    assert!(next_term > term, "terms strictly increase");
    assert!(
        took <= TTL + Duration::from_secs(1),
        "failover took {took:?}"
    );
    for mut r in replicas {
        let _ = r.kill();
        let _ = r.wait();
    }
    Ok(())
}
