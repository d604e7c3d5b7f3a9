//! A host of the test's own for network-partition tests: a network namespace joined to the
//! root namespace by a veth pair on a private /30 of 10.251.0.0/16 (the root end `.1`, the
//! namespace end `.2`). A program run in it (`command`) reaches the root namespace only at
//! the root end's address, where a private server can listen (`PrivatePg::start_with`).
//!
//! `cut` takes the namespace's end down: its routes go, so nothing it sends leaves, and the
//! root end loses its carrier, so what the root side sends to it is dropped silently (the
//! route stays, marked linkdown, and no packet takes the default route out of the machine).
//! Established connections are not told: their statements hang and the server's side
//! hears nothing, as in a real partition. `heal` brings it up again (the addresses stay, the
//! routes come back) and the connections carry on where TCP's retransmissions left them.
//!
//! Dropping it deletes the namespace, which deletes the veth pair with it, also while a panic
//! unwinds. A namespace left by a test process that was killed (named after its pid) is
//! deleted by the next one made.

use std::process::Command;

/// Prefix of every namespace and interface made here: `dlk<pid>n<n>`, `dlk<pid>r<n>`.
const PREFIX: &str = "dlk";

pub struct Netns {
    name: String,
    root_dev: String,
    ns_dev: String,
    /// The root end's address (where servers listen for the namespace).
    pub root_addr: String,
    /// The namespace end's address (where its connections come from).
    pub ns_addr: String,
}

/// Runs `ip ARGS`; the error text if it fails.
fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip {}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn ip_ok(args: &[&str]) {
    if let Err(e) = ip(args) {
        panic!("{e}");
    }
}

fn ip_output(args: &[&str]) -> String {
    Command::new("ip")
        .args(args)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

/// Deletes namespaces of this module left by test processes that no longer exist.
fn sweep_leftovers() {
    for line in ip_output(&["netns", "list"]).lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        let pid = name
            .strip_prefix(PREFIX)
            .and_then(|rest| rest.split_once('n'))
            .and_then(|(pid, _)| pid.parse::<u32>().ok());
        if let Some(pid) = pid {
            if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
                let _ = ip(&["netns", "del", name]);
            }
        }
    }
}

/// A /30 of 10.251.0.0/16 with no address of this machine in it: (root end, namespace end).
fn free_subnet() -> (String, String) {
    let taken = ip_output(&["-o", "-4", "addr", "show"]);
    let start = (std::process::id() as usize * 7) % 16384;
    for i in 0..16384 {
        let n = (start + i) % 16384;
        let (third, fourth) = (n >> 6, (n & 63) << 2);
        let net = format!("10.251.{third}.");
        let (root, ns) = (
            format!("{net}{}", fourth + 1),
            format!("{net}{}", fourth + 2),
        );
        if !taken.contains(&format!("{root}/")) && !taken.contains(&format!("{ns}/")) {
            return (root, ns);
        }
    }
    panic!("no free /30 in 10.251.0.0/16");
}

impl Netns {
    /// A new namespace and veth pair, up and addressed. `None` (the test skips, saying why)
    /// where this machine does not allow network namespaces, unless `DLOCK_TEST_REQUIRE` is
    /// `all` or names `netns`: then it panics instead, so CI never skips these tests.
    pub fn create() -> Option<Netns> {
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        sweep_leftovers();
        let (pid, n) = (std::process::id(), N.fetch_add(1, Ordering::Relaxed));
        let name = format!("{PREFIX}{pid}n{n}");
        if let Err(e) = ip(&["netns", "add", &name]) {
            assert!(
                !super::required("netns"),
                "network namespaces are not available ({e}) but DLOCK_TEST_REQUIRE asks for them"
            );
            eprintln!("skipped: this machine does not allow network namespaces ({e})");
            return None;
        }
        let (root_addr, ns_addr) = free_subnet();
        // From here on, Drop deletes what was made.
        let ns = Netns {
            root_dev: format!("{PREFIX}{pid}r{n}"),
            ns_dev: format!("{PREFIX}{pid}v{n}"),
            name,
            root_addr,
            ns_addr,
        };
        ip_ok(&[
            "link",
            "add",
            &ns.root_dev,
            "type",
            "veth",
            "peer",
            "name",
            &ns.ns_dev,
        ]);
        ip_ok(&["link", "set", &ns.ns_dev, "netns", &ns.name]);
        ip_ok(&[
            "addr",
            "add",
            &format!("{}/30", ns.root_addr),
            "dev",
            &ns.root_dev,
        ]);
        ip_ok(&["link", "set", &ns.root_dev, "up"]);
        ns.in_ns(&[
            "addr",
            "add",
            &format!("{}/30", ns.ns_addr),
            "dev",
            &ns.ns_dev,
        ]);
        ns.in_ns(&["link", "set", &ns.ns_dev, "up"]);
        ns.in_ns(&["link", "set", "lo", "up"]);
        Some(ns)
    }

    /// `ip ARGS` inside the namespace.
    fn in_ns(&self, args: &[&str]) {
        let mut all = vec!["netns", "exec", &self.name, "ip"];
        all.extend_from_slice(args);
        ip_ok(&all);
    }

    /// `program` to be run inside the namespace.
    pub fn command(&self, program: &std::path::Path) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.name]).arg(program);
        c
    }

    /// The root namespace's TCP connections with the namespace, as `ss` shows them.
    pub fn connections(&self) -> Vec<String> {
        let out = Command::new("ss")
            .args(["-tnoH", "state", "established", "dst", &self.ns_addr])
            .output()
            .expect("run ss");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_owned)
            .collect()
    }

    /// Waits (at most `within`) until the namespace has acknowledged everything the root
    /// namespace sent it: a cut then leaves the server's side of each connection idle, so
    /// that its TCP keepalives, not retransmissions, decide when it gives up. (A reply still
    /// unacknowledged at the cut, for up to 200 ms of delayed ACK, is retransmitted instead,
    /// for up to 15 minutes by Linux's default `tcp_retries2`.)
    pub fn wait_until_acknowledged(&self, within: std::time::Duration) {
        let deadline = std::time::Instant::now() + within;
        loop {
            let connections = self.connections();
            // "Recv-Q Send-Q local peer …"
            let unacked = connections
                .iter()
                .any(|c| c.split_whitespace().nth(1) != Some("0"));
            if !unacked {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "data still unacknowledged after {within:?}: {connections:#?}"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    /// Cuts the link: from now on no packet passes either way.
    pub fn cut(&self) {
        self.in_ns(&["link", "set", &self.ns_dev, "down"]);
    }

    /// Heals the link.
    pub fn heal(&self) {
        self.in_ns(&["link", "set", &self.ns_dev, "up"]);
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // Deleting the namespace deletes its end of the pair, and with it the other end.
        // Never panic here: this may run while a test's panic unwinds.
        if let Err(e) = ip(&["netns", "del", &self.name]) {
            eprintln!("could not delete the network namespace: {e}");
        }
        let _ = ip(&["link", "del", &self.root_dev]);
    }
}
