//! A private three-node MariaDB Galera cluster on loopback, for the multi-primary tests: each
//! node a `mariadbd` in a directory of its own (run as `mysql` when we are root), its client
//! port, its group-communication port (gcomm), its IST and SST ports all free ports of
//! 127.0.0.1. Node 0 bootstraps the cluster (`--wsrep-new-cluster`) and creates the users;
//! nodes 1 and 2 join and receive the data by rsync SST. `start` returns once every node
//! reports `wsrep_cluster_size = 3`, `wsrep_ready = ON` and `wsrep_local_state_comment =
//! Synced`, or panics with the nodes' logs after `START_DEADLINE`.
//!
//! `kill9(node)` crashes one node (the server and any SST child it has). Everything is
//! SIGKILLed and removed when the value drops, also while a panic unwinds; a watchdog shell
//! beside each node kills it if the test process dies without dropping it.
//!
//! The provider is Debian's `galera-4` (`/usr/lib/galera/libgalera_smm.so`); rsync SST needs
//! `rsync` and one of `ss`/`lsof`/`sockstat` (`wsrep_sst_rsync` checks the port with them).
#![allow(dead_code)]

use super::private_server::{children_of, exited};
use diesel::{Connection, MysqlConnection, QueryableByName, RunQueryDsl};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const PROVIDER: &str = "/usr/lib/galera/libgalera_smm.so";
/// How long the whole cluster may take to start.
const START_DEADLINE: Duration = Duration::from_secs(90);

/// Whether this machine has mariadbd, the Galera provider and rsync; if not, prints why the
/// test skips (or panics when `DLOCK_TEST_REQUIRE` asks for `galera`).
pub fn available() -> bool {
    let missing: Vec<&str> = [
        "/usr/sbin/mariadbd",
        PROVIDER,
        "/usr/bin/rsync",
        "/usr/bin/wsrep_sst_rsync",
    ]
    .into_iter()
    .filter(|p| !Path::new(p).exists())
    .collect();
    if missing.is_empty() {
        return true;
    }
    assert!(
        !super::required("galera"),
        "{missing:?} missing but DLOCK_TEST_REQUIRE asks for galera"
    );
    eprintln!("skipped: {missing:?} missing (no private Galera cluster)");
    false
}

fn is_root() -> bool {
    let out = Command::new("id").arg("-u").output().expect("run id -u");
    String::from_utf8_lossy(&out.stdout).trim() == "0"
}

/// `n` distinct ports of 127.0.0.1 nobody listened on a moment ago (all bound at once, so
/// distinct).
fn free_ports(n: usize) -> Vec<u16> {
    let held: Vec<_> = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port"))
        .collect();
    held.iter()
        .map(|l| l.local_addr().unwrap().port())
        .collect()
}

fn run_ok(mut cmd: Command, what: &str) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// One node: its ports, its directory, its process and watchdog while it runs.
struct Node {
    dir: PathBuf,
    port: u16,
    gcomm: u16,
    ist: u16,
    sst: u16,
    server: Option<Child>,
    watchdog: Option<Child>,
}

impl Node {
    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }
    fn log(&self) -> PathBuf {
        self.path("server.log")
    }

    /// SIGKILLs the server and its children (an rsync of an SST), waits until all have exited.
    fn kill9(&mut self) {
        if let Some(mut w) = self.watchdog.take() {
            let _ = w.kill();
            let _ = w.wait();
        }
        let Some(mut server) = self.server.take() else {
            return;
        };
        let pid = Pid::from_raw(server.id() as i32);
        let _ = kill(pid, Signal::SIGSTOP);
        let children = children_of(server.id());
        for &c in &children {
            let _ = kill(Pid::from_raw(c), Signal::SIGKILL);
        }
        let _ = kill(pid, Signal::SIGKILL);
        let _ = server.wait();
        let deadline = Instant::now() + Duration::from_secs(30);
        while !children.iter().all(|&c| exited(c)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// The cluster. Fields drop in order: the nodes (killed) before the directory.
pub struct Galera {
    nodes: Vec<Node>,
    _dir: tempfile::TempDir,
}

#[derive(QueryableByName)]
struct Var {
    #[diesel(sql_type = diesel::sql_types::Text, column_name = "Variable_name")]
    name: String,
    #[diesel(sql_type = diesel::sql_types::Text, column_name = "Value")]
    value: String,
}

impl Galera {
    /// Starts three nodes and returns once all three are synced members of one cluster.
    pub fn start() -> Galera {
        Self::start_n(3)
    }

    pub fn start_n(n: usize) -> Galera {
        let started = Instant::now();
        let dir = tempfile::Builder::new()
            .prefix("dlock-galera-")
            .tempdir()
            .expect("tempdir");
        let user = is_root().then_some("mysql");
        let ports = free_ports(4 * n);
        let mut nodes: Vec<Node> = (0..n)
            .map(|i| Node {
                dir: dir.path().join(format!("node{i}")),
                port: ports[4 * i],
                gcomm: ports[4 * i + 1],
                ist: ports[4 * i + 2],
                sst: ports[4 * i + 3],
                server: None,
                watchdog: None,
            })
            .collect();
        let chown = |path: &Path| {
            if let Some(user) = user {
                let mut c = Command::new("chown");
                c.args(["-R", &format!("{user}:{user}")]).arg(path);
                run_ok(c, "chown the cluster's directory");
            }
        };
        for node in &nodes {
            fs::create_dir_all(node.path("tmp")).unwrap();
            chown(dir.path());
            let mut install = Command::new("mariadb-install-db");
            install
                .arg("--no-defaults")
                .arg(format!("--datadir={}", node.path("data").display()))
                .args(["--auth-root-authentication-method=normal", "--skip-test-db"])
                .arg(format!("--tmpdir={}", node.path("tmp").display()));
            if let Some(user) = user {
                install.arg(format!("--user={user}"));
            }
            run_ok(install, "mariadb-install-db");
        }
        fs::write(
            nodes[0].path("init.sql"),
            "CREATE DATABASE IF NOT EXISTS dlock;\n\
             CREATE USER IF NOT EXISTS 'dlock'@'%' IDENTIFIED BY 'dlock';\n\
             GRANT ALL ON *.* TO 'dlock'@'%';\n",
        )
        .unwrap();
        chown(dir.path());
        let cluster_address = format!(
            "gcomm://{}",
            nodes
                .iter()
                .map(|n| format!("127.0.0.1:{}", n.gcomm))
                .collect::<Vec<_>>()
                .join(",")
        );
        let mut g = Galera {
            nodes: Vec::new(),
            _dir: dir,
        };
        for i in 0..n {
            spawn(&mut nodes[i], i, user, &cluster_address);
            if i == 0 {
                // The others join a cluster that exists: wait for the first to be ready.
                g.nodes = nodes;
                g.wait_synced(&[0], 1, started);
                nodes = std::mem::take(&mut g.nodes);
            }
        }
        g.nodes = nodes;
        let all: Vec<usize> = (0..n).collect();
        g.wait_synced(&all, n, started);
        eprintln!(
            "galera: {n} nodes synced in {:.1} s",
            started.elapsed().as_secs_f64()
        );
        g
    }

    /// Waits until each of `nodes` answers with `wsrep_cluster_size = size`, ready and synced.
    pub fn wait_synced(&mut self, nodes: &[usize], size: usize, started: Instant) {
        let deadline = started + START_DEADLINE;
        loop {
            let mut last = String::new();
            let mut ok = true;
            for &i in nodes {
                match self.status(i) {
                    Ok(s) => {
                        let get = |k: &str| {
                            s.iter()
                                .find(|(n, _)| n == k)
                                .map(|(_, v)| v.as_str())
                                .unwrap_or("")
                        };
                        let good = get("wsrep_cluster_size") == size.to_string()
                            && get("wsrep_ready") == "ON"
                            && get("wsrep_local_state_comment") == "Synced";
                        if !good {
                            ok = false;
                            last = format!(
                                "node {i}: size {} ready {} state {}",
                                get("wsrep_cluster_size"),
                                get("wsrep_ready"),
                                get("wsrep_local_state_comment")
                            );
                        }
                    }
                    Err(e) => {
                        ok = false;
                        last = format!("node {i}: {e}");
                    }
                }
                if let Some(server) = self.nodes[i].server.as_mut() {
                    if let Ok(Some(status)) = server.try_wait() {
                        panic!(
                            "galera node {i} exited ({status}) while starting\n{}",
                            self.logs()
                        );
                    }
                }
            }
            if ok {
                return;
            }
            if Instant::now() > deadline {
                panic!(
                    "the Galera cluster was not synced within {START_DEADLINE:?} ({last})\n{}",
                    self.logs()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The `wsrep_%` status of node `i`.
    pub fn status(&self, i: usize) -> Result<Vec<(String, String)>, String> {
        let mut c = MysqlConnection::establish(&self.url(i)).map_err(|e| e.to_string())?;
        diesel::sql_query("SHOW STATUS LIKE 'wsrep%'")
            .load::<Var>(&mut c)
            .map(|v| v.into_iter().map(|v| (v.name, v.value)).collect())
            .map_err(|e| e.to_string())
    }

    /// One status variable of node `i`.
    pub fn status_of(&self, i: usize, name: &str) -> Option<String> {
        self.status(i)
            .ok()?
            .into_iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v)
    }

    /// The last lines of every node's log.
    pub fn logs(&self) -> String {
        let mut out = String::new();
        for (i, n) in self.nodes.iter().enumerate() {
            let text = fs::read_to_string(n.log()).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let tail = &lines[lines.len().saturating_sub(40)..];
            out += &format!(
                "---- node {i} ({}) ----\n{}\n",
                n.log().display(),
                tail.join("\n")
            );
        }
        out
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// User `dlock` (password `dlock`, every privilege) on node `i`, database `dlock`.
    pub fn url(&self, i: usize) -> String {
        format!("mysql://dlock:dlock@127.0.0.1:{}/dlock", self.nodes[i].port)
    }

    pub fn port(&self, i: usize) -> u16 {
        self.nodes[i].port
    }

    /// SIGKILLs node `i` (a crash of that node alone).
    pub fn kill9(&mut self, i: usize) {
        self.nodes[i].kill9();
    }

    pub fn is_running(&self, i: usize) -> bool {
        self.nodes[i].server.is_some()
    }
}

impl Drop for Galera {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            n.kill9();
        }
    }
}

fn spawn(node: &mut Node, i: usize, user: Option<&str>, cluster_address: &str) {
    let mut cmd = Command::new("mariadbd");
    cmd.arg("--no-defaults")
        .arg(format!("--datadir={}", node.path("data").display()))
        .arg(format!("--tmpdir={}", node.path("tmp").display()))
        .arg(format!("--socket={}", node.path("mysqld.sock").display()))
        .arg(format!("--pid-file={}", node.path("mysqld.pid").display()))
        .arg(format!("--port={}", node.port))
        .arg("--bind-address=127.0.0.1")
        .args(["--skip-name-resolve", "--innodb-buffer-pool-size=32M"])
        .args(["--binlog-format=ROW", "--innodb-autoinc-lock-mode=2"])
        .args(["--default-storage-engine=InnoDB", "--wsrep-on=ON"])
        .arg(format!("--wsrep-provider={PROVIDER}"))
        .arg("--wsrep-cluster-name=dlock")
        .arg(format!("--wsrep-cluster-address={cluster_address}"))
        .arg(format!("--wsrep-node-name=node{i}"))
        .arg(format!("--wsrep-node-address=127.0.0.1:{}", node.gcomm))
        .arg(format!(
            "--wsrep-node-incoming-address=127.0.0.1:{}",
            node.port
        ))
        .arg(format!(
            "--wsrep-sst-receive-address=127.0.0.1:{}",
            node.sst
        ))
        .arg("--wsrep-sst-method=rsync")
        .arg(format!(
            "--wsrep-provider-options=base_port={};gmcast.listen_addr=tcp://127.0.0.1:{};\
             ist.recv_addr=127.0.0.1:{};gcache.size=32M",
            node.gcomm, node.gcomm, node.ist
        ));
    if i == 0 {
        cmd.arg("--wsrep-new-cluster")
            .arg(format!("--init-file={}", node.path("init.sql").display()));
    }
    if let Some(user) = user {
        cmd.arg(format!("--user={user}"));
    }
    let log = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(node.log())
        .expect("open the node's log");
    cmd.stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log);
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    let server = cmd.spawn().expect("spawn mariadbd");
    let watchdog = Command::new("sh")
        .args([
            "-c",
            "read _; kill -STOP $1; pkill -KILL -P $1; kill -KILL $1",
            "dlock-galera-watchdog",
            &server.id().to_string(),
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn the watchdog");
    node.server = Some(server);
    node.watchdog = Some(watchdog);
}
