//! Child processes for the tests of several processes: the test binary run again with
//! `DLOCK_CHILD` set (backend, URL, a lease ttl in ms, key, mode), entering through the
//! ignored `child_entry` test that `child_entry!` defines in the test file.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

pub struct Kid {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Kid {
    pub fn spawn(backend: &str, url: &str, ttl_ms: u64, key: &str, mode: &str) -> Kid {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "child_entry",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(
                "DLOCK_CHILD",
                [backend, url, &ttl_ms.to_string(), key, mode].join("\t"),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        Kid {
            stdin: child.stdin.take().unwrap(),
            stdout: BufReader::new(child.stdout.take().unwrap()),
            child,
        }
    }

    /// What the child says from `word` on, in the next line holding it (libtest's chatter
    /// is skipped).
    pub fn expect(&mut self, word: &str) -> String {
        let mut line = String::new();
        loop {
            line.clear();
            let n = self.stdout.read_line(&mut line).unwrap();
            assert!(n > 0, "child exited before saying {word:?}");
            if let Some(at) = line.find(word) {
                return line[at..].trim_end().to_owned();
            }
        }
    }

    pub fn tell(&mut self, line: &str) {
        writeln!(self.stdin, "{line}").unwrap();
        self.stdin.flush().unwrap();
    }

    /// The child's process id (for signals such as SIGSTOP).
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn kill9(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for Kid {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A line to the parent.
pub fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}").unwrap();
    out.flush().unwrap();
}

/// A line from the parent.
pub fn hear() -> String {
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line).unwrap();
    line.trim_end().to_owned()
}

/// Defines the ignored `child_entry` test, which runs `$main::<C>(harness, ttl, key, mode)`
/// on the backend the parent named.
#[macro_export]
macro_rules! child_entry {
    ($main:ident) => {
        #[test]
        #[ignore = "entry point for the child processes that the other tests spawn"]
        fn child_entry() {
            let Ok(spec) = std::env::var("DLOCK_CHILD") else {
                return;
            };
            let p: Vec<&str> = spec.split('\t').collect();
            let ttl = std::time::Duration::from_millis(p[2].parse().unwrap());
            let (backend, url, key, mode) = (p[0], p[1], p[3], p[4]);
            match backend {
                "sqlite" => $main(common::sqlite_at(url, 12), ttl, key, mode),
                #[cfg(feature = "postgres")]
                "pg" => $main(
                    common::server_at::<diesel::PgConnection>(url, 12),
                    ttl,
                    key,
                    mode,
                ),
                #[cfg(feature = "postgres")]
                "pgbouncer" => $main(common::pgbouncer_at(url, 12), ttl, key, mode),
                #[cfg(feature = "mysql")]
                "mysql" => $main(
                    common::server_at::<diesel::MysqlConnection>(url, 12),
                    ttl,
                    key,
                    mode,
                ),
                other => panic!("unknown backend {other}"),
            }
        }
    };
}
