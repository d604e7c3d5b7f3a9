//! Network partitions: the holder runs in a network namespace of the test's own
//! (`common::netns`), joined by a veth pair to a private server (`common::private_server`)
//! that also listens on the root end's address; the test cuts the link mid-hold and heals it
//! later. The holder is this test binary run again inside the namespace (`ip netns exec`),
//! entering through the ignored `child_entry` test; it reports what its guards say, with the
//! wall-clock time, one line each on its stdout.
//!
//! - `Lease`: the holder's guard reports the loss before another client takes the key (by the
//!   database's clock, which is this machine's), and after healing the old holder's late
//!   renewal does not renew over the new holder.
//! - `Advisory` and `ForUpdate`: how long the server keeps a partitioned holder's lock, with
//!   default settings (past the test's bound: the kernel's keepalive defaults make it 2 h 11
//!   min) and with TCP keepalives (the suite's 2 s idle, 1 s interval, 2 probes; set
//!   `DLOCK_PARTITION_KEEPALIVE=idle,interval,probes` to measure others), and what the holder's
//!   `check()` says.
//!
//! SQLite has no network: a partition does not apply to it.
#![cfg(any(feature = "postgres", feature = "mysql"))]

mod common;

use common::netns::Netns;
use common::private_server;
use common::unique_key;
use diesel::r2d2::{ConnectionManager, Pool};
use diesel_lock::{Error, LockConnection, LockGuard, Locker, Strategy};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// This machine's wall clock in µs: what the database servers (private, on this machine)
/// read too.
fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros() as i64
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}").unwrap();
    out.flush().unwrap();
}

/// Waits for the parent's `word` on stdin.
fn wait_for(word: &str) {
    let mut line = String::new();
    loop {
        line.clear();
        let n = std::io::stdin().lock().read_line(&mut line).unwrap();
        assert!(n > 0, "the parent went away before saying {word}");
        if line.trim() == word {
            return;
        }
    }
}

fn verdict(r: diesel_lock::Result<()>) -> String {
    match r {
        Ok(()) => "held".into(),
        Err(Error::LockLost { .. }) => "lost".into(),
        Err(e) => format!("error:{}", e.to_string().replace(' ', "_")),
    }
}

/// The holder's pool. Waits for a connection are short: inside the partition none can be
/// made (the namespace has no route out), and nothing should wait long for that.
fn child_pool<C: LockConnection>(url: &str) -> Pool<ConnectionManager<C>> {
    Pool::builder()
        .max_size(4)
        .min_idle(Some(0))
        .connection_timeout(Duration::from_secs(2))
        .build(ConnectionManager::<C>::new(url))
        .unwrap()
}

#[test]
#[ignore = "entry point for the partitioned holders that the other tests spawn"]
fn child_entry() {
    let Ok(spec) = std::env::var("DLOCK_PARTITION_CHILD") else {
        return;
    };
    let p: Vec<&str> = spec.split('\t').collect();
    let (backend, url, mode, key) = (p[0], p[1], p[2], p[3]);
    let ttl = Duration::from_millis(p[4].parse().unwrap());
    match backend {
        #[cfg(feature = "postgres")]
        "pg" => child_main::<diesel::PgConnection>(url, mode, key, ttl),
        #[cfg(feature = "mysql")]
        "mysql" => child_main::<diesel::MysqlConnection>(url, mode, key, ttl),
        other => panic!("unknown backend {other}"),
    }
}

fn child_main<C: LockConnection>(url: &str, mode: &str, key: &str, ttl: Duration) {
    match mode {
        "lease" => lease_child::<C>(url, key, ttl),
        "sessions" => sessions_child::<C>(url, key),
        other => panic!("unknown mode {other}"),
    }
}

/// Holds a lease and checks it every 2 ms until the guard says it is lost: "LOSS-REPORTED
/// <last Ok, µs> <first LockLost, µs> <other errors>". After "HEALED", waits until every
/// statement it had in flight has ended (each pooled connection back: "SETTLED"), and says
/// what the guard says then ("AFTER <verdict>").
fn lease_child<C: LockConnection>(url: &str, key: &str, ttl: Duration) {
    let pool = child_pool::<C>(url);
    let locker = Locker::builder(pool.clone())
        .owner("partitioned")
        .strategy(Strategy::Lease { ttl })
        .build()
        .unwrap();
    let g = locker.lock(key).unwrap();
    // Once before the parent cuts the link (which it does as soon as it reads HELD).
    g.check().unwrap();
    let (mut last_ok, mut errors) = (now_us(), 0);
    say(&format!("HELD {}", g.token()));
    let give_up = Instant::now() + Duration::from_secs(60);
    loop {
        let answer = g.check();
        let at = now_us();
        match answer {
            Ok(()) => last_ok = at,
            Err(Error::LockLost { .. }) => {
                say(&format!("LOSS-REPORTED {last_ok} {at} {errors}"));
                break;
            }
            Err(e) => {
                errors += 1;
                eprintln!("partitioned holder: check: {e}");
            }
        }
        if Instant::now() > give_up {
            say("NO-LOSS");
            break;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    wait_for("HEALED");
    let settle_by = Instant::now() + Duration::from_secs(120);
    loop {
        let s = pool.state();
        if s.idle_connections == s.connections {
            say("SETTLED");
            break;
        }
        if Instant::now() > settle_by {
            say("UNSETTLED");
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    say(&format!("AFTER {}", verdict(g.check())));
    wait_for("EXIT");
}

/// Holds `<key>-advisory` and `<key>-for-update`; on "CHECK", checks each on a thread of its
/// own and says "CHECKED <strategy> <verdict> <µs>" whenever that returns.
fn sessions_child<C: LockConnection>(url: &str, key: &str) {
    let guards: Vec<(&str, LockGuard<C>)> = [
        ("advisory", Strategy::Advisory),
        ("for-update", Strategy::ForUpdate),
    ]
    .into_iter()
    .map(|(name, s)| {
        let locker = Locker::builder(child_pool::<C>(url))
            .owner("partitioned")
            .strategy(s)
            .build()
            .unwrap();
        (name, locker.lock(&format!("{key}-{name}")).unwrap())
    })
    .collect();
    say(&format!(
        "HELD {} {}",
        guards[0].1.token(),
        guards[1].1.token()
    ));
    wait_for("CHECK");
    for (name, g) in guards {
        std::thread::spawn(move || {
            let answer = verdict(g.check());
            say(&format!("CHECKED {name} {answer} {}", now_us()));
            // The guard stays alive until the process ends.
            loop {
                std::thread::park();
            }
        });
    }
    wait_for("EXIT");
}

/// A partitioned holder: the child process inside `net`, and its lines as they come.
struct Kid {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
}

impl Kid {
    fn spawn(net: &Netns, backend: &str, url: &str, mode: &str, key: &str, ttl: Duration) -> Kid {
        let mut child = net
            .command(&std::env::current_exe().unwrap())
            .args([
                "--exact",
                "child_entry",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(
                "DLOCK_PARTITION_CHILD",
                [backend, url, mode, key, &ttl.as_millis().to_string()].join("\t"),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in stdout.lines() {
                let Ok(line) = line else { return };
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        Kid {
            stdin: child.stdin.take().unwrap(),
            child,
            lines,
        }
    }

    /// The next line holding one of `words`, from that word on, waiting at most `within`.
    /// libtest's own chatter is skipped, and may stand on the same line before it.
    fn expect_any(&mut self, words: &[&str], within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = match self.lines.recv_timeout(left) {
                Ok(line) => line,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    panic!("the holder did not say any of {words:?} within {within:?}")
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    panic!("the holder exited before saying any of {words:?}")
                }
            };
            let found = words.iter().filter_map(|w| line.find(w)).min();
            if let Some(at) = found {
                return line[at..].trim_end().to_owned();
            }
        }
    }

    fn expect(&mut self, word: &str, within: Duration) -> String {
        self.expect_any(&[word], within)
    }

    fn tell(&mut self, line: &str) {
        writeln!(self.stdin, "{line}").unwrap();
        self.stdin.flush().unwrap();
    }
}

impl Drop for Kid {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// TCP keepalive settings of a private server: seconds idle before the first probe, seconds
/// between probes, probes unanswered before the server drops the connection.
#[derive(Debug, Clone, Copy)]
struct Keepalive {
    idle: u32,
    interval: u32,
    probes: u32,
}

impl Keepalive {
    /// The suite's (short, to keep the test short), or `DLOCK_PARTITION_KEEPALIVE`.
    fn for_test() -> Keepalive {
        let Ok(spec) = std::env::var("DLOCK_PARTITION_KEEPALIVE") else {
            return Keepalive {
                idle: 2,
                interval: 1,
                probes: 2,
            };
        };
        let v: Vec<u32> = spec.split(',').map(|n| n.trim().parse().unwrap()).collect();
        Keepalive {
            idle: v[0],
            interval: v[1],
            probes: v[2],
        }
    }

    /// When the server gives up on a silent client: idle + interval × probes.
    fn expected(&self) -> Duration {
        Duration::from_secs(u64::from(self.idle + self.interval * self.probes))
    }
}

/// A private server reachable from the namespace; dropped (killed, removed) with the test.
struct Server {
    root_url: String,
    ns_url: String,
    _server: Box<dyn std::any::Any>,
}

impl Server {
    /// `None` (skip, said why) where the machine has no such server, unless required.
    fn start(backend: &str, net: &Netns, keepalive: Option<Keepalive>) -> Option<Server> {
        if !private_server::available(backend) {
            return None;
        }
        let listen = [net.root_addr.as_str()];
        Some(match backend {
            #[cfg(feature = "postgres")]
            "pg" => {
                let settings: Vec<(&str, String)> = keepalive
                    .map(|k| {
                        vec![
                            ("tcp_keepalives_idle", k.idle.to_string()),
                            ("tcp_keepalives_interval", k.interval.to_string()),
                            ("tcp_keepalives_count", k.probes.to_string()),
                        ]
                    })
                    .unwrap_or_default();
                let settings: Vec<(&str, &str)> =
                    settings.iter().map(|(k, v)| (*k, v.as_str())).collect();
                let s = private_server::PrivatePg::start_configured(&listen, &settings);
                Server {
                    root_url: s.url(),
                    ns_url: s.url_on(&net.root_addr),
                    _server: Box::new(s),
                }
            }
            #[cfg(feature = "mysql")]
            "mysql" => {
                let options: Vec<String> = keepalive
                    .map(|k| {
                        vec![
                            format!("--tcp-keepalive-time={}", k.idle),
                            format!("--tcp-keepalive-interval={}", k.interval),
                            format!("--tcp-keepalive-probes={}", k.probes),
                        ]
                    })
                    .unwrap_or_default();
                let options: Vec<&str> = options.iter().map(String::as_str).collect();
                let s = private_server::PrivateMaria::start_configured(&listen, &options);
                Server {
                    root_url: s.url(),
                    ns_url: s.url_on(&net.root_addr),
                    _server: Box::new(s),
                }
            }
            other => panic!("unknown backend {other}"),
        })
    }
}

fn ms(us: i64) -> f64 {
    us as f64 / 1000.0
}

/// A `Lease` holder cut off mid-hold: its guard says "lost" before anyone else can take the
/// key, and after healing its late renewal does not renew over the new holder.
fn lease_holder_reports_the_loss_first<C: LockConnection>(backend: &str) {
    let Some(net) = Netns::create() else { return };
    let Some(server) = Server::start(backend, &net, None) else {
        return;
    };
    let ttl = Duration::from_secs(3);
    let competitor = Locker::builder(common::pool::<C>(&server.root_url, 4))
        .owner("competitor")
        .strategy(Strategy::Lease { ttl })
        .max_backoff(Duration::from_millis(5))
        .build()
        .unwrap();
    competitor.migrate().unwrap();
    let key = unique_key("partition-lease");
    let mut kid = Kid::spawn(&net, backend, &server.ns_url, "lease", &key, ttl);
    let held = kid.expect("HELD", Duration::from_secs(60));
    let old_token: i64 = held.split(' ').nth(1).unwrap().parse().unwrap();
    assert!(competitor.try_lock(&key).unwrap().is_none(), "not held");

    net.cut();
    let cut_at = now_us();
    let new = competitor
        .try_lock_for(&key, ttl * 3)
        .unwrap()
        .expect("the partitioned holder's lease never expired");
    // By the database's clock: the moment it judged the old lease expired.
    let taken_at = new.acquired_at().timestamp_micros();
    let report = kid.expect_any(&["LOSS-REPORTED", "NO-LOSS"], ttl * 3);
    let v: Vec<i64> = report
        .strip_prefix("LOSS-REPORTED ")
        .unwrap_or_else(|| panic!("the guard never said the lease was lost: {report}"))
        .split(' ')
        .map(|n| n.parse().unwrap())
        .collect();
    let (last_ok, lost_at, errors) = (v[0], v[1], v[2]);
    eprintln!(
        "{backend} lease, ttl {ttl:?}: cut -> loss reported {:.1} ms; loss reported {:.1} ms \
         and last Ok {:.1} ms before the key was taken (cut -> taken {:.1} ms); {errors} \
         other errors from check()",
        ms(lost_at - cut_at),
        ms(taken_at - lost_at),
        ms(taken_at - last_ok),
        ms(taken_at - cut_at),
    );
    assert!(
        last_ok < taken_at,
        "check() said held {} ms after the key was taken",
        ms(last_ok - taken_at)
    );
    assert!(
        lost_at < taken_at,
        "the loss was reported {} ms after the key was taken",
        ms(lost_at - taken_at)
    );
    assert!(new.token() > old_token);

    net.heal();
    kid.tell("HEALED");
    // Every statement the old holder had in flight (its renewal, its check) has ended: they
    // reached the database only after the new holder took the key.
    assert_eq!(
        kid.expect_any(&["SETTLED", "UNSETTLED"], Duration::from_secs(150)),
        "SETTLED"
    );
    assert_eq!(kid.expect("AFTER", Duration::from_secs(30)), "AFTER lost");
    // The new holder keeps the key through its own renewals for a while: the old one's late
    // renewal matched nothing.
    let until = Instant::now() + ttl;
    while Instant::now() < until {
        new.check().unwrap();
        let mut conn = common::pool::<C>(&server.root_url, 1).get().unwrap();
        let info = diesel_lock::admin::lock_info(&mut *conn, &key).unwrap();
        assert_eq!(info.len(), 1, "{info:?}");
        assert_eq!(
            (info[0].token, info[0].owner.as_str()),
            (new.token(), "competitor")
        );
        std::thread::sleep(ttl / 6);
    }
    kid.tell("EXIT");
    new.release().unwrap();
}

/// `Advisory` and `ForUpdate` holders cut off mid-hold: how long the server keeps their
/// locks, and what their `check()` says.
fn sessions_kept_by_the_server<C: LockConnection>(backend: &str, keepalive: Option<Keepalive>) {
    let Some(net) = Netns::create() else { return };
    let Some(server) = Server::start(backend, &net, keepalive) else {
        return;
    };
    let pool = common::pool::<C>(&server.root_url, 4);
    let lockers: Vec<(&str, Locker<C>)> = [
        ("advisory", Strategy::Advisory),
        ("for-update", Strategy::ForUpdate),
    ]
    .into_iter()
    .map(|(name, s)| {
        let l = Locker::builder(pool.clone())
            .owner("competitor")
            .strategy(s)
            .build()
            .unwrap();
        l.migrate().unwrap();
        (name, l)
    })
    .collect();
    let key = unique_key("partition-session");
    let mut kid = Kid::spawn(
        &net,
        backend,
        &server.ns_url,
        "sessions",
        &key,
        Duration::ZERO,
    );
    let held = kid.expect("HELD", Duration::from_secs(60));
    let old_tokens: Vec<i64> = held
        .split(' ')
        .skip(1)
        .map(|t| t.parse().unwrap())
        .collect();
    for (name, l) in &lockers {
        assert!(l.try_lock(&format!("{key}-{name}")).unwrap().is_none());
    }

    // A holder working on what it locked: its session idle, everything acknowledged.
    net.wait_until_acknowledged(Duration::from_secs(5));
    net.cut();
    let cut = Instant::now();
    kid.tell("CHECK");
    // With default settings the server would keep the locks for 2 h 11 min (the kernel's
    // keepalive defaults); the test watches for a bounded time only.
    let watch = keepalive.map_or(Duration::from_secs(10), |k| {
        k.expected() * 3 + Duration::from_secs(10)
    });
    let mut taken: Vec<Option<(Duration, LockGuard<C>)>> = vec![None, None];
    while cut.elapsed() < watch && taken.iter().any(Option::is_none) {
        for (i, (name, l)) in lockers.iter().enumerate() {
            if taken[i].is_none() {
                if let Some(g) = l.try_lock(&format!("{key}-{name}")).unwrap() {
                    taken[i] = Some((cut.elapsed(), g));
                }
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    // What the holder's check() said while the link was down, if anything.
    let during: Vec<String> = kid
        .lines
        .try_iter()
        .filter(|l| l.contains("CHECKED"))
        .collect();
    net.heal();
    let healed = Instant::now();
    let mut after = Vec::new();
    for _ in during.len()..2 {
        let line = kid.expect("CHECKED", Duration::from_secs(120));
        after.push((line, healed.elapsed()));
    }
    for (i, (name, _)) in lockers.iter().enumerate() {
        let kept = match &taken[i] {
            Some((d, _)) => format!("freed {:.1} s after the cut", d.as_secs_f64()),
            None => format!("still held {:.1} s after the cut", watch.as_secs_f64()),
        };
        eprintln!("{backend} {name}, keepalive {keepalive:?}: {kept}");
    }
    eprintln!(
        "{backend}: holder's check() during the partition: {during:?}; after healing: {after:?}"
    );
    // check() has no deadline of its own: on a connection that hangs it waits for TCP.
    assert!(
        during.is_empty(),
        "check() returned while partitioned: {during:?}"
    );
    let verdicts: Vec<String> = after
        .iter()
        .map(|(line, _)| line.split(' ').take(3).collect::<Vec<_>>().join(" "))
        .collect();
    match keepalive {
        None => {
            assert!(
                taken.iter().all(Option::is_none),
                "freed within {watch:?} with default settings"
            );
            // The session lived through the partition: the holder still holds, rightly.
            for (name, _) in &lockers {
                assert!(
                    verdicts.contains(&format!("CHECKED {name} held")),
                    "{verdicts:?}"
                );
            }
        }
        Some(k) => {
            for (i, (name, _)) in lockers.iter().enumerate() {
                let (d, g) = taken[i]
                    .as_ref()
                    .unwrap_or_else(|| panic!("{name}: still held {watch:?} after the cut"));
                assert!(
                    *d < k.expected() * 3 + Duration::from_secs(5),
                    "{name}: freed only after {d:?}"
                );
                assert!(g.token() > old_tokens[i]);
                g.check().unwrap();
                assert!(
                    verdicts.contains(&format!("CHECKED {name} lost")),
                    "{verdicts:?}"
                );
            }
        }
    }
    kid.tell("EXIT");
}

macro_rules! partition_tests {
    ($module:ident, $backend:literal, $conn:ty) => {
        mod $module {
            use super::*;

            #[test]
            fn lease_holder_reports_the_loss_before_the_key_is_taken() {
                lease_holder_reports_the_loss_first::<$conn>($backend);
            }

            #[test]
            fn session_locks_with_default_settings() {
                sessions_kept_by_the_server::<$conn>($backend, None);
            }

            #[test]
            fn session_locks_with_keepalives() {
                sessions_kept_by_the_server::<$conn>($backend, Some(Keepalive::for_test()));
            }
        }
    };
}

#[cfg(feature = "postgres")]
partition_tests!(pg, "pg", diesel::PgConnection);
#[cfg(feature = "mysql")]
partition_tests!(mysql, "mysql", diesel::MysqlConnection);

/// With libpq's `tcp_user_timeout` in the holder's URL, a session guard's `check()` fails in
/// a partition instead of waiting for TCP's own give-up (15 minutes by Linux's defaults): the
/// check statement stays unacknowledged, and the kernel ends the connection after that long.
#[cfg(feature = "postgres")]
#[test]
fn pg_session_check_fails_with_a_client_tcp_user_timeout() {
    let Some(net) = Netns::create() else { return };
    let Some(server) = Server::start("pg", &net, None) else {
        return;
    };
    Locker::builder(common::pool::<diesel::PgConnection>(&server.root_url, 1))
        .strategy(Strategy::Advisory)
        .build()
        .unwrap()
        .migrate()
        .unwrap();
    let url = format!("{}&tcp_user_timeout=2000", server.ns_url);
    let key = unique_key("partition-user-timeout");
    let mut kid = Kid::spawn(&net, "pg", &url, "sessions", &key, Duration::ZERO);
    kid.expect("HELD", Duration::from_secs(60));
    net.wait_until_acknowledged(Duration::from_secs(5));
    net.cut();
    let cut = Instant::now();
    kid.tell("CHECK");
    let mut verdicts: Vec<String> = (0..2)
        .map(|_| {
            let line = kid.expect("CHECKED", Duration::from_secs(60));
            line.split(' ').take(3).collect::<Vec<_>>().join(" ")
        })
        .collect();
    let took = cut.elapsed();
    eprintln!("pg, tcp_user_timeout=2000: check() answered {took:?} after the cut: {verdicts:?}");
    verdicts.sort();
    assert_eq!(
        verdicts,
        ["CHECKED advisory lost", "CHECKED for-update lost"],
        "while the link was still down"
    );
    kid.tell("EXIT");
}
