//! A MariaDB primary and its replica, both private (`PrivateMaria`), for failover tests: the
//! primary has a binary log (`--server-id=1`, GTIDs), the replica (`--server-id=2`,
//! `read_only`) replicates from it with `MASTER_USE_GTID = slave_pos` as user `repl`.
//!
//! - `make_lag` stops the replica's IO thread: what the primary commits from then on never
//!   reaches the replica;
//! - `catch_up` waits until the replica has applied everything the primary has logged;
//! - `crash_primary` SIGKILLs the primary, `stop_primary` shuts it down cleanly;
//! - `promote` makes the replica a primary (`STOP SLAVE; RESET SLAVE ALL; SET GLOBAL
//!   read_only = OFF`), after it applied what it had received.
//!
//! Clients reach the current primary either through its own URL (`replica_url` after the
//! promotion) or through `proxy_url`, a TCP forwarder standing for a virtual IP or a
//! connection router: `promote` points it at the replica and cuts every connection it was
//! carrying, so that a `Locker` (and its guards) made before the failover carry on against
//! the new primary.
//!
//! The replica is started first, at least a second before the primary: a replica that has
//! run longer than its primary is the usual case after any restart of the primary, and it is
//! the harder one for tokens drawn from a server-wide counter started from the clock at the
//! server's start (`UUID_SHORT()`): the replica's counter starts lower.
//!
//! Everything (servers, directories, proxy threads) goes when the value drops, also while a
//! test's panic unwinds.
#![allow(dead_code)]

use super::private_server::PrivateMaria;
use diesel::connection::SimpleConnection;
use diesel::sql_types::{BigInt, Text};
use diesel::{Connection, MysqlConnection, QueryableByName, RunQueryDsl};
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A primary, its replica and a proxy in front of whichever is primary.
pub struct ReplicaPair {
    /// Dropped first: no connection is carried to a server being killed.
    proxy: Proxy,
    /// `None` once crashed or stopped.
    primary: Option<PrivateMaria>,
    replica: PrivateMaria,
    primary_url: String,
    primary_admin_url: String,
    promoted: bool,
}

#[derive(QueryableByName)]
struct Gtid {
    #[diesel(sql_type = Text)]
    pos: String,
}

#[derive(QueryableByName)]
struct Num {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// The columns of `SHOW SLAVE STATUS` read here.
#[derive(QueryableByName, Debug)]
struct SlaveStatus {
    #[diesel(sql_type = Text, column_name = Slave_IO_Running)]
    slave_io_running: String,
    #[diesel(sql_type = Text, column_name = Slave_SQL_Running)]
    slave_sql_running: String,
    #[diesel(sql_type = Text, column_name = Gtid_IO_Pos)]
    gtid_io_pos: String,
    #[diesel(sql_type = Text, column_name = Last_Error)]
    last_error: String,
    #[diesel(sql_type = Text, column_name = Last_IO_Error)]
    last_io_error: String,
}

fn admin(url: &str) -> MysqlConnection {
    MysqlConnection::establish(url).unwrap_or_else(|e| panic!("connect to {url}: {e}"))
}

fn gtid_binlog_pos(c: &mut MysqlConnection) -> String {
    diesel::sql_query("SELECT CAST(@@GLOBAL.gtid_binlog_pos AS CHAR) AS pos")
        .get_result::<Gtid>(c)
        .unwrap()
        .pos
}

fn slave_status(c: &mut MysqlConnection) -> SlaveStatus {
    diesel::sql_query("SHOW SLAVE STATUS")
        .get_result::<SlaveStatus>(c)
        .unwrap()
}

impl ReplicaPair {
    /// Starts both servers and replication, and returns once the replica runs both threads
    /// and has applied everything the primary logged.
    pub fn start() -> ReplicaPair {
        let started = Instant::now();
        let replica = PrivateMaria::start_configured(
            &[],
            &[
                "--log-bin=mysql-bin",
                "--server-id=2",
                "--read-only=ON",
                "--log-slave-updates=ON",
                "--relay-log=relay-bin",
            ],
        );
        // The primary's server start (UUID_SHORT's clock) in a later second than the
        // replica's.
        std::thread::sleep(Duration::from_millis(1100));
        let primary = PrivateMaria::start_configured(
            &[],
            &[
                "--log-bin=mysql-bin",
                "--server-id=1",
                "--binlog-format=MIXED",
            ],
        );
        admin(&primary.admin_url())
            .batch_execute(
                "CREATE USER 'repl'@'%' IDENTIFIED BY 'repl'; \
                 GRANT REPLICATION SLAVE ON *.* TO 'repl'@'%';",
            )
            .unwrap();
        admin(&replica.admin_url())
            .batch_execute(&format!(
                "CHANGE MASTER TO MASTER_HOST = '127.0.0.1', MASTER_PORT = {}, \
                   MASTER_USER = 'repl', MASTER_PASSWORD = 'repl', \
                   MASTER_USE_GTID = slave_pos, MASTER_CONNECT_RETRY = 1; \
                 START SLAVE;",
                primary.port()
            ))
            .unwrap();
        let proxy = Proxy::start(primary.port());
        let pair = ReplicaPair {
            proxy,
            primary_url: primary.url(),
            primary_admin_url: primary.admin_url(),
            primary: Some(primary),
            replica,
            promoted: false,
        };
        let mut r = admin(&pair.replica.admin_url());
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let s = slave_status(&mut r);
            if s.slave_io_running == "Yes" && s.slave_sql_running == "Yes" {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "replication never started: {s:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        pair.catch_up();
        eprintln!(
            "primary (:{}) and replica (:{}) replicating in {:?}",
            pair.primary.as_ref().unwrap().port(),
            pair.replica.port(),
            started.elapsed()
        );
        pair
    }

    /// The primary's own URL (user `dlock`).
    pub fn primary_url(&self) -> String {
        self.primary_url.clone()
    }

    /// The replica's own URL (user `dlock`, which may write even while `read_only` is on:
    /// use it only after `promote`).
    pub fn replica_url(&self) -> String {
        self.replica.url()
    }

    pub fn replica_admin_url(&self) -> String {
        self.replica.admin_url()
    }

    pub fn primary_admin_url(&self) -> String {
        self.primary_admin_url.clone()
    }

    /// The URL through the proxy (user `dlock`): the primary, and the replica once promoted.
    pub fn proxy_url(&self) -> String {
        format!("mysql://dlock:dlock@127.0.0.1:{}/dlock", self.proxy.port)
    }

    /// Waits (up to 30 s) until the replica has applied everything the primary has logged.
    pub fn catch_up(&self) {
        assert!(!self.promoted, "the replica is the primary now");
        let pos = gtid_binlog_pos(&mut admin(&self.primary_admin_url));
        let waited = diesel::sql_query("SELECT CAST(MASTER_GTID_WAIT(?, 30) AS SIGNED) AS n")
            .bind::<Text, _>(&pos)
            .get_result::<Num>(&mut admin(&self.replica.admin_url()))
            .unwrap()
            .n;
        assert_eq!(waited, 0, "the replica did not reach {pos} in 30 s");
    }

    /// Stops the replica's IO thread: nothing the primary commits from now on reaches it.
    pub fn make_lag(&self) {
        admin(&self.replica.admin_url())
            .batch_execute("STOP SLAVE IO_THREAD")
            .unwrap();
    }

    /// SIGKILLs the primary.
    pub fn crash_primary(&mut self) {
        let mut p = self.primary.take().expect("the primary runs");
        p.kill9();
    }

    /// Shuts the primary down cleanly (after `catch_up`: a switchover).
    pub fn stop_primary(&mut self) {
        let mut p = self.primary.take().expect("the primary runs");
        p.stop_clean();
    }

    /// The replica applies what it received, stops replicating, forgets its primary and
    /// accepts writes; the proxy then leads to it (its old connections are cut).
    pub fn promote(&mut self) {
        let started = Instant::now();
        let mut r = admin(&self.replica.admin_url());
        // What the IO thread received, applied first (as a failover tool would).
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let received = slave_status(&mut r).gtid_io_pos;
            let applied = diesel::sql_query("SELECT CAST(@@GLOBAL.gtid_slave_pos AS CHAR) AS pos")
                .get_result::<Gtid>(&mut r)
                .unwrap()
                .pos;
            if received == applied || received.is_empty() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the replica never applied {received} (at {applied})"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        r.batch_execute("STOP SLAVE; RESET SLAVE ALL; SET GLOBAL read_only = OFF;")
            .unwrap();
        self.promoted = true;
        self.proxy.switch_to(self.replica.port());
        eprintln!("replica promoted in {:?}", started.elapsed());
    }

    /// A row count on the replica (or the new primary), as the admin.
    pub fn count_on_replica(&self, sql: &str) -> i64 {
        diesel::sql_query(sql)
            .get_result::<Num>(&mut admin(&self.replica.admin_url()))
            .unwrap()
            .n
    }
}

/// A TCP forwarder on 127.0.0.1: each connection it accepts is joined to the target port of
/// the moment; `switch_to` changes the target and cuts every connection it carries.
struct Proxy {
    port: u16,
    target: Arc<AtomicU16>,
    /// Both ends of every connection carried, for cutting them.
    carried: Arc<Mutex<Vec<TcpStream>>>,
    stop: Arc<AtomicBool>,
    acceptor: Option<JoinHandle<()>>,
}

impl Proxy {
    fn start(target: u16) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let target = Arc::new(AtomicU16::new(target));
        let carried = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let acceptor = {
            let (target, carried, stop) = (target.clone(), carried.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Acquire) {
                    let client = match listener.accept() {
                        Ok((c, _)) => c,
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                            std::thread::sleep(Duration::from_millis(5));
                            continue;
                        }
                        Err(_) => continue,
                    };
                    let _ = client.set_nonblocking(false);
                    let to = target.load(Ordering::Acquire);
                    // Refused (the server is down): the client sees its connection closed.
                    let Ok(server) = TcpStream::connect(("127.0.0.1", to)) else {
                        continue;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    let mut list = carried.lock().unwrap();
                    list.retain(|s: &TcpStream| s.peer_addr().is_ok());
                    list.push(client.try_clone().unwrap());
                    list.push(server.try_clone().unwrap());
                    drop(list);
                    pipe(client.try_clone().unwrap(), server.try_clone().unwrap());
                    pipe(server, client);
                }
            })
        };
        Proxy {
            port,
            target,
            carried,
            stop,
            acceptor: Some(acceptor),
        }
    }

    fn cut_all(&self) {
        for s in self.carried.lock().unwrap().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    fn switch_to(&self, port: u16) {
        self.target.store(port, Ordering::Release);
        self.cut_all();
    }
}

/// Copies `from` to `to` on a thread of its own until either end closes, then closes both.
fn pipe(mut from: TcpStream, mut to: TcpStream) {
    std::thread::spawn(move || {
        let mut buf = [0u8; 16 * 1024];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            }
        }
        let _ = from.shutdown(Shutdown::Both);
        let _ = to.shutdown(Shutdown::Both);
    });
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        self.cut_all();
        if let Some(a) = self.acceptor.take() {
            let _ = a.join();
        }
    }
}
