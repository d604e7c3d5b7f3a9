//! A private PostgreSQL primary with a streaming standby of its own, for failover tests: the
//! standby is a `pg_basebackup -R` of the primary (run as the `postgres` user), on a free
//! port of its own, streaming from the primary asynchronously or synchronously. Both servers
//! are `PrivatePg`s: they are killed and removed on drop, also while a panic unwinds.
//!
//! - `make_lag` stops the primary's walsender with SIGSTOP once the standby has replayed
//!   everything the primary has written: commits after it do not reach the standby
//!   (`resume` sends SIGCONT).
//! - `crash_primary` is `PrivatePg::kill9`; `restart_primary` runs crash recovery and waits
//!   for the standby to stream again.
//! - `promote` promotes the standby (`pg_promote`) and waits until it accepts writes over
//!   the multi-host URL; `switchover` stops the primary cleanly, waits until the standby
//!   has replayed its shutdown checkpoint, then promotes.
//! - `multi_host_url` names both servers with `target_session_attrs=read-write`: libpq
//!   connects to whichever accepts writes, so pools follow the promotion.
#![cfg(feature = "postgres")]

use super::private_server::PrivatePg;
use diesel::sql_types::{Nullable, Text};
use diesel::{Connection, OptionalExtension, PgConnection, QueryableByName, RunQueryDsl};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use std::time::{Duration, Instant};

/// How long the harness waits for the standby (to stream, to catch up, to be promoted).
const DEADLINE: Duration = Duration::from_secs(30);

/// How the primary waits for the standby.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replication {
    /// Commits return once flushed locally; the standby follows as it can.
    Async,
    /// `synchronous_standby_names = '*'`, `synchronous_commit = on`: a commit returns once
    /// the standby has flushed it.
    Sync,
}

/// A primary and its standby. After `promote` or `switchover` the standby is the primary
/// (`url` then names it) and the old primary is down for good.
pub struct ReplicaPg {
    primary: PrivatePg,
    standby: PrivatePg,
    mode: Replication,
    /// The walsender stopped by `make_lag`.
    stopped_walsender: Option<i32>,
    promoted: bool,
}

#[derive(QueryableByName)]
struct V {
    #[diesel(sql_type = Nullable<Text>)]
    v: Option<String>,
}

/// The first row's column `v` of `sql` (a query selecting one text column named `v`), on a
/// new connection to `url`; `None` for no row or NULL.
pub fn query_text(url: &str, sql: &str) -> Result<Option<String>, String> {
    let mut c = PgConnection::establish(url).map_err(|e| format!("connect to {url}: {e}"))?;
    diesel::sql_query(sql)
        .get_result::<V>(&mut c)
        .optional()
        .map(|r| r.and_then(|r| r.v))
        .map_err(|e| format!("{sql}: {e}"))
}

/// Runs `sql` (one or more statements) on a new connection to `url`.
pub fn execute(url: &str, sql: &str) {
    use diesel::connection::SimpleConnection;
    PgConnection::establish(url)
        .unwrap_or_else(|e| panic!("connect to {url}: {e}"))
        .batch_execute(sql)
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// Polls `check` every 10 ms until it says `Ok(true)`; panics with `what` and the last
/// answer after `limit`.
pub fn poll_until(what: &str, limit: Duration, mut check: impl FnMut() -> Result<bool, String>) {
    let deadline = Instant::now() + limit;
    loop {
        let last = match check() {
            Ok(true) => return,
            Ok(false) => "not yet".to_owned(),
            Err(e) => e,
        };
        assert!(
            Instant::now() < deadline,
            "{what}: not within {limit:?} ({last})"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The timeline of the server at `url` (the first 8 hex digits of its current WAL file;
/// on a standby, of the WAL it replays).
pub fn timeline(url: &str) -> u32 {
    let name = query_text(
        url,
        "SELECT pg_walfile_name(CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() \
         ELSE pg_current_wal_lsn() END) AS v",
    )
    .unwrap()
    .expect("a WAL file name");
    u32::from_str_radix(&name[..8], 16).expect("a hex timeline")
}

impl ReplicaPg {
    /// A primary and a standby streaming from it, in `mode`; returns once the standby
    /// streams (synchronously, in `Sync` mode).
    pub fn start(mode: Replication) -> ReplicaPg {
        let mut settings = vec![
            ("wal_level", "replica"),
            ("max_wal_senders", "4"),
            // A standby reconnecting after a crash of the primary finds its WAL there.
            ("wal_keep_size", "128MB"),
        ];
        if mode == Replication::Sync {
            settings.extend([
                // A -c value is taken as is: no quotes.
                ("synchronous_standby_names", "*"),
                ("synchronous_commit", "on"),
            ]);
        }
        let primary = PrivatePg::start_configured(&[], &settings);
        let port = primary.port().to_string();
        // initdb's pg_hba.conf trusts replication connections over loopback.
        let standby = PrivatePg::start_from(
            |data, program| {
                let mut backup = program("pg_basebackup");
                backup
                    .args(["-h", "127.0.0.1", "-p", &port, "-U", "postgres"])
                    .arg("-D")
                    .arg(data)
                    .args(["-R", "-X", "stream", "-c", "fast", "--no-sync"]);
                let out = backup.output().expect("run pg_basebackup");
                assert!(
                    out.status.success(),
                    "pg_basebackup failed ({}): {}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr)
                );
            },
            &[
                ("hot_standby", "on"),
                // Reconnects to a restarted primary at once (5 s by default).
                ("wal_retrieve_retry_interval", "100ms"),
                // (The primary's settings are its command line, which a base backup does
                // not copy: once promoted, it waits for no synchronous standby.)
            ],
        );
        let r = ReplicaPg {
            primary,
            standby,
            mode,
            stopped_walsender: None,
            promoted: false,
        };
        r.wait_streaming();
        r
    }

    /// Waits until the primary's walsender streams to the standby (synchronously in `Sync`
    /// mode) and the standby has replayed all the primary has written.
    fn wait_streaming(&self) {
        let want = match self.mode {
            Replication::Async => "streaming",
            Replication::Sync => "streaming sync",
        };
        poll_until("the standby streams", DEADLINE, || {
            let state = query_text(
                &self.primary.url(),
                "SELECT string_agg(state || CASE WHEN sync_state = 'sync' THEN ' sync' ELSE '' END, ',') AS v \
                 FROM pg_stat_replication",
            )?;
            Ok(state.as_deref() == Some(want))
        });
        self.wait_replayed();
    }

    /// The current primary (the standby once promoted).
    pub fn url(&self) -> String {
        if self.promoted {
            self.standby.url()
        } else {
            self.primary.url()
        }
    }

    /// The first primary, over 127.0.0.1 alone.
    pub fn primary_url(&self) -> String {
        self.primary.url()
    }

    /// The standby, over 127.0.0.1 alone.
    pub fn standby_url(&self) -> String {
        self.standby.url()
    }

    /// Both servers, for libpq to connect to whichever accepts writes.
    pub fn multi_host_url(&self) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/postgres?target_session_attrs=read-write&sslmode=disable&connect_timeout=10",
            self.primary.port(),
            self.standby.port()
        )
    }

    /// Waits until the standby has replayed all WAL the primary has written so far.
    pub fn wait_replayed(&self) {
        let lsn = query_text(
            &self.primary.url(),
            "SELECT pg_current_wal_lsn()::text AS v",
        )
        .unwrap()
        .expect("an LSN");
        self.wait_replayed_past(&lsn, false);
    }

    /// Waits until the standby's replay position reaches `lsn` (passes it, if `strictly`).
    fn wait_replayed_past(&self, lsn: &str, strictly: bool) {
        let op = if strictly { ">" } else { ">=" };
        let sql = format!("SELECT (pg_last_wal_replay_lsn() {op} '{lsn}'::pg_lsn)::text AS v");
        poll_until(
            &format!("the standby replays up to {lsn}"),
            DEADLINE,
            || Ok(query_text(&self.standby.url(), &sql)?.as_deref() == Some("true")),
        );
    }

    /// Stops the walsender (SIGSTOP) once the standby has replayed everything: from here on
    /// the primary's commits do not reach the standby (an asynchronous one; a synchronous
    /// primary's commits would wait).
    pub fn make_lag(&mut self) {
        assert!(self.stopped_walsender.is_none(), "already lagging");
        self.wait_replayed();
        let pid: i32 = query_text(
            &self.primary.url(),
            "SELECT string_agg(pid::text, ',') AS v FROM pg_stat_replication",
        )
        .unwrap()
        .expect("a walsender")
        .parse()
        .expect("exactly one walsender");
        kill(Pid::from_raw(pid), Signal::SIGSTOP).expect("SIGSTOP the walsender");
        self.stopped_walsender = Some(pid);
    }

    /// The standby's last replayed LSN.
    pub fn standby_replay_lsn(&self) -> String {
        query_text(
            &self.standby.url(),
            "SELECT pg_last_wal_replay_lsn()::text AS v",
        )
        .unwrap()
        .expect("a replay LSN")
    }

    /// The primary's current WAL position.
    pub fn primary_lsn(&self) -> String {
        query_text(
            &self.primary.url(),
            "SELECT pg_current_wal_lsn()::text AS v",
        )
        .unwrap()
        .expect("an LSN")
    }

    /// Lets the stopped walsender go on (SIGCONT).
    pub fn resume(&mut self) {
        let pid = self.stopped_walsender.take().expect("lagging");
        kill(Pid::from_raw(pid), Signal::SIGCONT).expect("SIGCONT the walsender");
    }

    /// SIGKILLs the primary and all its processes (a stopped walsender too).
    pub fn crash_primary(&mut self) {
        self.stopped_walsender = None;
        self.primary.kill9();
    }

    /// Starts the crashed primary again (crash recovery) and waits until the standby
    /// streams from it again and has caught up.
    pub fn restart_primary(&mut self) {
        assert!(!self.promoted, "the standby was promoted");
        self.primary.restart();
        self.wait_streaming();
    }

    /// Promotes the standby and waits until the multi-host URL reaches it and it accepts
    /// writes. Returns how long that took.
    pub fn promote(&mut self) -> Duration {
        let t = Instant::now();
        // Without waiting: a session waiting in `pg_promote(true)` holds a snapshot, which
        // the replay of a cleanup record still ahead may wait for, up to
        // max_standby_streaming_delay (30 s), while the promotion waits for that replay
        // (seen: "server did not promote within 30 seconds", the startup process waiting
        // on RecoveryConflictSnapshot).
        let asked = query_text(&self.standby.url(), "SELECT pg_promote(false)::text AS v");
        assert_eq!(asked, Ok(Some("true".to_owned())), "pg_promote");
        self.promoted = true;
        let url = self.multi_host_url();
        poll_until("the promoted standby accepts writes", DEADLINE, || {
            let port = query_text(
                &url,
                "SELECT current_setting('port') || CASE WHEN pg_is_in_recovery() THEN ' in recovery' ELSE '' END AS v",
            )?;
            Ok(port == Some(self.standby.port().to_string()))
        });
        t.elapsed()
    }

    /// A clean switchover: the primary stops cleanly (its walsender sends all of its WAL,
    /// the shutdown checkpoint last), the standby replays past that checkpoint, and is
    /// promoted.
    pub fn switchover(&mut self) -> Duration {
        assert!(
            self.stopped_walsender.is_none(),
            "resume before a switchover"
        );
        let t = Instant::now();
        self.primary.stop_clean();
        let out = self
            .primary
            .program("pg_controldata")
            .arg(self.primary.data_dir())
            .output()
            .expect("run pg_controldata");
        let text = String::from_utf8_lossy(&out.stdout);
        let checkpoint = text
            .lines()
            .find_map(|l| l.strip_prefix("Latest checkpoint location:"))
            .unwrap_or_else(|| panic!("no checkpoint location in:\n{text}"))
            .trim()
            .to_owned();
        let state = text
            .lines()
            .find_map(|l| l.strip_prefix("Database cluster state:"))
            .map(str::trim);
        assert_eq!(
            state,
            Some("shut down"),
            "the primary did not shut down cleanly:\n{text}"
        );
        // The replay position is the end of the last record replayed: past the checkpoint
        // record's start once that record is replayed.
        self.wait_replayed_past(&checkpoint, true);
        self.promote();
        t.elapsed()
    }

    /// The standby's server log.
    pub fn standby_log(&self) -> String {
        std::fs::read_to_string(self.standby.dir().join("server.log")).unwrap_or_default()
    }

    pub fn mode(&self) -> Replication {
        self.mode
    }

    /// The old primary (down after a crash or a switchover).
    pub fn primary(&mut self) -> &mut PrivatePg {
        &mut self.primary
    }

    pub fn standby(&mut self) -> &mut PrivatePg {
        &mut self.standby
    }
}
