//! Throwaway database servers of a test's own, for tests that crash or restart a database:
//! the shared servers are never stopped. Each instance lives in a temp directory, listens on
//! a free port of 127.0.0.1 (and of any extra local address asked for), trusts every client
//! and is removed when its value drops, also while a panic unwinds.
//!
//! `kill9` is a crash: every process of the server is SIGKILLed at once (PostgreSQL's children
//! call `setsid`, so its process group is not enough: the postmaster is stopped first, so that
//! it forks nothing new, then it and every child of it are killed). Whatever the server had
//! only in its own memory (WAL or redo-log buffers not yet written) is lost; what it had
//! written to the kernel survives, as it would on a crash of the server alone.
//!
//! Running as root, the servers run as the `postgres` / `mysql` users (neither runs as root),
//! started through `setpriv`, which execs: the child we hold is the server itself. A watchdog
//! shell beside each server kills it if the test process dies without dropping it (its stdin
//! is a pipe from us: end of file means we are gone).
#![allow(dead_code)]

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const PG_BIN: &str = "/usr/lib/postgresql/15/bin";
/// How long a start or a restart (crash recovery included) may take.
const START_DEADLINE: Duration = Duration::from_secs(90);

/// Whether this machine has the server's programs; if not, prints why the test skips, or
/// panics when `DLOCK_TEST_REQUIRE` asks for `backend` (`pg`, `mysql`).
pub fn available(backend: &str) -> bool {
    let program = match backend {
        "pg" => format!("{PG_BIN}/initdb"),
        "mysql" => "/usr/sbin/mariadbd".to_owned(),
        other => panic!("unknown backend {other}"),
    };
    if Path::new(&program).exists() {
        return true;
    }
    assert!(
        !super::required(backend),
        "{program} is missing but DLOCK_TEST_REQUIRE asks for {backend}"
    );
    eprintln!("skipped: {program} is missing (no private {backend} server)");
    false
}

fn is_root() -> bool {
    let out = Command::new("id").arg("-u").output().expect("run id -u");
    String::from_utf8_lossy(&out.stdout).trim() == "0"
}

/// A port of 127.0.0.1 nobody listened on a moment ago. Another process may take it before
/// the server binds it: `start` then fails with the server's log, and is rare enough.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind an ephemeral port")
        .port()
}

/// `cmd` run as `user` (when we are root) or as ourselves.
fn command_as(user: Option<&str>, program: &str) -> Command {
    match user {
        Some(user) => {
            let mut c = Command::new("setpriv");
            c.args([
                &format!("--reuid={user}"),
                &format!("--regid={user}"),
                "--init-groups",
                "--",
                program,
            ]);
            c
        }
        None => Command::new(program),
    }
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

fn chown_to(user: Option<&str>, path: &Path) {
    if let Some(user) = user {
        let mut c = Command::new("chown");
        c.args(["-R", &format!("{user}:{user}")]).arg(path);
        run_ok(c, "chown the server's directory");
    }
}

/// The process ids whose parent is `parent`, from /proc.
pub fn children_of(parent: u32) -> Vec<i32> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| {
            let pid: i32 = e.ok()?.file_name().to_str()?.parse().ok()?;
            let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            // "pid (comm) state ppid ...": comm may hold spaces and parentheses.
            let ppid: u32 = stat
                .rsplit_once(')')?
                .1
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()?;
            (ppid == parent).then_some(pid)
        })
        .collect()
}

/// Whether `pid` is gone or a zombie (exited, memory released).
pub fn exited(pid: i32) -> bool {
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with(['Z', 'X'])),
        Err(_) => true,
    }
}

/// One running server process, its log and its watchdog.
struct Running {
    server: Child,
    watchdog: Child,
}

impl Running {
    fn spawn(mut cmd: Command, log: &Path) -> Running {
        let log_file = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .expect("open the server log");
        cmd.stdin(Stdio::null())
            .stdout(log_file.try_clone().unwrap())
            .stderr(log_file);
        // Its own process group: a terminal's ^C to the test reaches the test only, which
        // then drops us and stops the server itself.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let server = cmd.spawn().expect("spawn the server");
        let watchdog = Command::new("sh")
            .args([
                "-c",
                // EOF on stdin: the test process is gone. Stop, kill the children, kill.
                "read _; kill -STOP $1; pkill -KILL -P $1; kill -KILL $1",
                "dlock-test-watchdog",
                &server.id().to_string(),
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn the watchdog");
        Running { server, watchdog }
    }

    fn pid(&self) -> Pid {
        Pid::from_raw(self.server.id() as i32)
    }

    /// SIGKILLs the server and all its children, and returns once every one has exited.
    fn kill9(mut self) {
        // The watchdog first (it holds the server's pid, which is about to be freed).
        let _ = self.watchdog.kill();
        let _ = self.watchdog.wait();
        let pid = self.pid();
        // Stopped, the postmaster forks no child we could miss; SIGKILL works on it anyway.
        let _ = kill(pid, Signal::SIGSTOP);
        let children = children_of(self.server.id());
        for &child in &children {
            let _ = kill(Pid::from_raw(child), Signal::SIGKILL);
        }
        let _ = kill(pid, Signal::SIGKILL);
        let _ = self.server.wait();
        // A child still exiting would still hold the shared memory a restart checks.
        let deadline = Instant::now() + Duration::from_secs(30);
        while !children.iter().all(|&c| exited(c)) {
            assert!(Instant::now() < deadline, "server children did not exit");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Sends `signal` (the server's clean shutdown) and waits for the server to exit.
    fn stop(mut self, signal: Signal) {
        let _ = self.watchdog.kill();
        let _ = self.watchdog.wait();
        let _ = kill(self.pid(), signal);
        let status = self.server.wait().expect("wait for the server");
        assert!(status.success(), "clean shutdown ended with {status}");
    }

    /// Polls `ready` until it holds; panics with the log if the server exits or the deadline
    /// passes first.
    fn wait_ready(&mut self, log: &Path, mut ready: impl FnMut() -> Result<(), String>) {
        let deadline = Instant::now() + START_DEADLINE;
        loop {
            let last = match ready() {
                Ok(()) => return,
                Err(e) => e,
            };
            let log_text = || fs::read_to_string(log).unwrap_or_default();
            if let Ok(Some(status)) = self.server.try_wait() {
                panic!(
                    "the server exited ({status}) while starting:\n{}",
                    log_text()
                );
            }
            if Instant::now() > deadline {
                panic!(
                    "the server did not accept connections in time ({last}):\n{}",
                    log_text()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// What both kinds of server share: the directory, the port, the addresses, the process.
struct Instance {
    /// Dropped last: the directory goes once the server is dead.
    dir: tempfile::TempDir,
    user: Option<&'static str>,
    port: u16,
    /// 127.0.0.1 first, then the extra addresses.
    addresses: Vec<String>,
    running: Option<Running>,
}

impl Instance {
    fn new(user: &'static str, extra_listen: &[&str]) -> Instance {
        let dir = tempfile::Builder::new()
            .prefix("dlock-server-")
            .tempdir()
            .expect("tempdir");
        let user = is_root().then_some(user);
        chown_to(user, dir.path());
        let mut addresses = vec!["127.0.0.1".to_owned()];
        addresses.extend(extra_listen.iter().map(|a| (*a).to_owned()));
        Instance {
            dir,
            user,
            port: free_port(),
            addresses,
            running: None,
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn log(&self) -> PathBuf {
        self.path("server.log")
    }

    fn kill9(&mut self) {
        self.running.take().expect("the server is running").kill9();
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        if let Some(r) = self.running.take() {
            r.kill9();
        }
    }
}

/// A PostgreSQL 15 server of the test's own: superuser `postgres`, trust authentication,
/// database `postgres`.
#[cfg(feature = "postgres")]
pub struct PrivatePg {
    inst: Instance,
    settings: Vec<(String, String)>,
}

#[cfg(feature = "postgres")]
impl PrivatePg {
    /// A server listening on 127.0.0.1 only.
    pub fn start() -> PrivatePg {
        Self::start_with(&[])
    }

    /// A server also listening on `extra_listen` (local addresses, such as a veth end), and
    /// trusting clients of any network it is directly connected to (`samenet`).
    pub fn start_with(extra_listen: &[&str]) -> PrivatePg {
        Self::start_configured(extra_listen, &[])
    }

    /// As `start_with`, plus server settings (`-c name=value`), e.g. `commit_delay`.
    pub fn start_configured(extra_listen: &[&str], settings: &[(&str, &str)]) -> PrivatePg {
        let inst = Instance::new("postgres", extra_listen);
        let mut initdb = command_as(inst.user, &format!("{PG_BIN}/initdb"));
        initdb
            .arg("-D")
            .arg(inst.path("data"))
            .args(["-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync"])
            .arg("--no-instructions");
        run_ok(initdb, "initdb");
        if extra_listen.is_empty() {
            // initdb's pg_hba.conf trusts loopback only, which is all we listen on.
        } else {
            fs::OpenOptions::new()
                .append(true)
                .open(inst.path("data/pg_hba.conf"))
                .and_then(|mut f| {
                    std::io::Write::write_all(&mut f, b"host all all samenet trust\n")
                })
                .expect("extend pg_hba.conf");
        }
        let mut pg = PrivatePg {
            inst,
            settings: settings
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        };
        pg.run();
        pg
    }

    /// A server on 127.0.0.1 whose data directory `fill` makes instead of initdb (a
    /// `pg_basebackup` of another server, say), with `settings` as `start_configured`'s.
    /// `fill` gets the data directory to create (in a directory the server's user owns) and
    /// a maker of commands that run a program of PostgreSQL's bin directory as that user.
    pub fn start_from(
        fill: impl FnOnce(&Path, &dyn Fn(&str) -> Command),
        settings: &[(&str, &str)],
    ) -> PrivatePg {
        let inst = Instance::new("postgres", &[]);
        let user = inst.user;
        fill(&inst.path("data"), &|program: &str| {
            command_as(user, &format!("{PG_BIN}/{program}"))
        });
        let mut pg = PrivatePg {
            inst,
            settings: settings
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        };
        pg.run();
        pg
    }

    /// A program of PostgreSQL's bin directory (`pg_ctl`, `pg_controldata`, ...), run as
    /// the server's user.
    pub fn program(&self, program: &str) -> Command {
        command_as(self.inst.user, &format!("{PG_BIN}/{program}"))
    }

    /// The data directory.
    pub fn data_dir(&self) -> PathBuf {
        self.inst.path("data")
    }

    /// Whether the server runs (it was neither killed nor stopped since its last start).
    pub fn is_running(&self) -> bool {
        self.inst.running.is_some()
    }

    fn run(&mut self) {
        assert!(self.inst.running.is_none(), "the server is already running");
        let i = &self.inst;
        let mut cmd = command_as(i.user, &format!("{PG_BIN}/postgres"));
        cmd.arg("-D")
            .arg(i.path("data"))
            .args(["-p", &i.port.to_string()])
            .arg("-c")
            .arg(format!("listen_addresses={}", i.addresses.join(",")))
            .arg("-c")
            .arg(format!(
                "unix_socket_directories={}",
                i.dir.path().display()
            ))
            .args([
                "-c",
                "fsync=on",
                "-c",
                "shared_buffers=16MB",
                "-c",
                "ssl=off",
            ]);
        for (k, v) in &self.settings {
            cmd.arg("-c").arg(format!("{k}={v}"));
        }
        let mut running = Running::spawn(cmd, &i.log());
        let url = self.url();
        running.wait_ready(&i.log(), || {
            <diesel::PgConnection as diesel::Connection>::establish(&url)
                .map(drop)
                .map_err(|e| e.to_string())
        });
        self.inst.running = Some(running);
    }

    /// The URL over 127.0.0.1.
    pub fn url(&self) -> String {
        self.url_on("127.0.0.1")
    }

    /// The URL over one of the addresses it listens on.
    pub fn url_on(&self, address: &str) -> String {
        format!(
            "postgres://postgres@{address}:{}/postgres?sslmode=disable&connect_timeout=10",
            self.inst.port
        )
    }

    pub fn port(&self) -> u16 {
        self.inst.port
    }

    /// The postmaster's process id.
    pub fn postmaster_pid(&self) -> u32 {
        self.inst.running.as_ref().expect("running").server.id()
    }

    /// The temp directory holding the data directory, the socket and `server.log`.
    pub fn dir(&self) -> PathBuf {
        self.inst.dir.path().to_owned()
    }

    /// SIGKILLs the postmaster and every child of it (a crash).
    pub fn kill9(&mut self) {
        self.inst.kill9();
    }

    /// Starts it again on the same data directory and port (crash recovery included) and
    /// returns once it accepts connections.
    pub fn restart(&mut self) {
        self.run();
    }

    /// A fast shutdown (SIGINT: running transactions roll back, a checkpoint is written).
    pub fn stop_clean(&mut self) {
        let r = self.inst.running.take().expect("the server is running");
        r.stop(Signal::SIGINT);
    }
}

/// A MariaDB server of the test's own: user `dlock` (password `dlock`, every privilege,
/// from any host), user `dlock_admin` (the same, with GRANT OPTION) and database `dlock`.
#[cfg(feature = "mysql")]
pub struct PrivateMaria {
    inst: Instance,
    options: Vec<String>,
}

#[cfg(feature = "mysql")]
impl PrivateMaria {
    /// A server listening on 127.0.0.1 only.
    pub fn start() -> PrivateMaria {
        Self::start_with(&[])
    }

    /// A server also listening on `extra_listen` (local addresses, such as a veth end).
    pub fn start_with(extra_listen: &[&str]) -> PrivateMaria {
        Self::start_configured(extra_listen, &[])
    }

    /// As `start_with`, plus server options (`--name=value`).
    pub fn start_configured(extra_listen: &[&str], options: &[&str]) -> PrivateMaria {
        let inst = Instance::new("mysql", extra_listen);
        fs::create_dir(inst.path("tmp")).expect("the server's temporary directory");
        chown_to(inst.user, inst.dir.path());
        let mut install = command_as(None, "mariadb-install-db");
        install
            .arg("--no-defaults")
            .arg(format!("--datadir={}", inst.path("data").display()))
            .args(["--auth-root-authentication-method=normal", "--skip-test-db"])
            // Its bootstrap server's temporary files in the instance's own directory: in the
            // shared /tmp another server starting at the same moment deleted them once
            // ("Error on delete of '/tmp/#sql-temptable-…'", seen in CI).
            .arg(format!("--tmpdir={}", inst.path("tmp").display()));
        if let Some(user) = inst.user {
            install.arg(format!("--user={user}"));
        }
        run_ok(install, "mariadb-install-db");
        // Run at every start (idempotent), before the server accepts connections.
        fs::write(
            inst.path("init.sql"),
            "CREATE DATABASE IF NOT EXISTS dlock;\n\
             CREATE USER IF NOT EXISTS 'dlock'@'%' IDENTIFIED BY 'dlock';\n\
             GRANT ALL ON *.* TO 'dlock'@'%';\n\
             CREATE USER IF NOT EXISTS 'dlock_admin'@'%' IDENTIFIED BY 'dlock';\n\
             GRANT ALL ON *.* TO 'dlock_admin'@'%' WITH GRANT OPTION;\n",
        )
        .expect("write init.sql");
        chown_to(inst.user, inst.dir.path());
        let mut m = PrivateMaria {
            inst,
            options: options.iter().map(|o| (*o).to_owned()).collect(),
        };
        m.run();
        m
    }

    fn run(&mut self) {
        assert!(self.inst.running.is_none(), "the server is already running");
        let i = &self.inst;
        let mut cmd = Command::new("mariadbd");
        cmd.arg("--no-defaults")
            .arg(format!("--datadir={}", i.path("data").display()))
            .arg(format!("--tmpdir={}", i.path("tmp").display()))
            .arg(format!("--socket={}", i.path("mysqld.sock").display()))
            .arg(format!("--pid-file={}", i.path("mysqld.pid").display()))
            .arg(format!("--init-file={}", i.path("init.sql").display()))
            .arg(format!("--port={}", i.port))
            .arg(format!("--bind-address={}", i.addresses.join(",")))
            // Reverse lookups of a veth peer could stall every connection.
            .args(["--skip-name-resolve", "--innodb-buffer-pool-size=32M"])
            .args(&self.options);
        if let Some(user) = i.user {
            cmd.arg(format!("--user={user}"));
        }
        let mut running = Running::spawn(cmd, &i.log());
        let url = self.url();
        running.wait_ready(&i.log(), || {
            <diesel::MysqlConnection as diesel::Connection>::establish(&url)
                .map(drop)
                .map_err(|e| e.to_string())
        });
        self.inst.running = Some(running);
    }

    /// The URL over 127.0.0.1.
    pub fn url(&self) -> String {
        self.url_on("127.0.0.1")
    }

    /// The URL over one of the addresses it listens on.
    pub fn url_on(&self, address: &str) -> String {
        format!("mysql://dlock:dlock@{address}:{}/dlock", self.inst.port)
    }

    pub fn port(&self) -> u16 {
        self.inst.port
    }

    /// The URL over 127.0.0.1 of `dlock_admin` (password `dlock`): every privilege, with
    /// GRANT OPTION, for creating users of fewer privileges and setting up replication.
    pub fn admin_url(&self) -> String {
        self.url_as("dlock_admin", "dlock")
    }

    /// The URL over 127.0.0.1 for another user of the server (made by the test).
    pub fn url_as(&self, user: &str, password: &str) -> String {
        format!(
            "mysql://{user}:{password}@127.0.0.1:{}/dlock",
            self.inst.port
        )
    }

    /// The temp directory holding the data directory, the socket and `server.log`.
    pub fn dir(&self) -> PathBuf {
        self.inst.dir.path().to_owned()
    }

    /// SIGKILLs mariadbd (a crash).
    pub fn kill9(&mut self) {
        self.inst.kill9();
    }

    /// Starts it again on the same data directory and port (crash recovery included) and
    /// returns once it accepts connections.
    pub fn restart(&mut self) {
        self.run();
    }

    /// A clean shutdown (SIGTERM).
    pub fn stop_clean(&mut self) {
        let r = self.inst.running.take().expect("the server is running");
        r.stop(Signal::SIGTERM);
    }
}
