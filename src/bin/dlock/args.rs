//! The command line: clap's definitions of the commands and their options, the parsers of
//! keys and durations (and the longest duration taken, with `deadline_after`, which never
//! overflows), the exit codes, and `Failure`, the exit code and message dlock stops with.

use clap::{Args, Parser, Subcommand, ValueEnum};
use diesel_lock::Error;
use std::ffi::OsString;
use std::io;
use std::time::{Duration, Instant};

/// The child's own status is passed through; these are dlock's.
pub(crate) const EXIT_RUNTIME: u8 = 1;
pub(crate) const EXIT_USAGE: u8 = 2;
pub(crate) const EXIT_NOT_ACQUIRED: u8 = 75; // EX_TEMPFAIL, as `flock -E 75` would
pub(crate) const EXIT_CANNOT_EXECUTE: u8 = 126;
pub(crate) const EXIT_NOT_FOUND: u8 = 127;

const EXIT_CODES: &str = "\
Exit codes:
  0    success (run: the command exited 0; status: the key is free)
  N    run: the command's own exit status; 128+S if it was killed by signal S
  1    runtime error (database unreachable, lock lost while the command ran, ...);
       status: the key is held
  2    usage error (bad option, duration, key or URL; a strategy, or a --shared,
       --write or --semaphore, that the strategy or backend lacks)
  75   run: the lock is held elsewhere and was not acquired (0 with --skip-ok)
  126  run: the command could not be executed
  127  run: the command was not found
  129/130/143  run: interrupted by SIGHUP/SIGINT/SIGTERM while waiting for the lock

Environment:
  DLOCK_URL   the database URL when --url is not given. Without either, dlock uses
              sqlite://dlock.db in the current directory and says so on stderr: that
              file excludes only runs in the same directory on the same machine. cron
              does not read your shell's exports: put DLOCK_URL=... in the crontab line
              (or use --url).
  RUST_LOG    log filter for --verbose (default: debug)";

/// Runs a command under a distributed lock kept in PostgreSQL, MySQL/MariaDB or SQLite.
#[derive(Debug, Parser)]
#[command(name = "dlock", version, after_help = EXIT_CODES)]
pub(crate) struct Cli {
    /// Database: postgres://…, mysql://…, sqlite://PATH or a plain file path (SQLite).
    /// Passwords in it are never printed. Default: sqlite://dlock.db in the current
    /// directory, with a warning on stderr (it excludes nothing on other machines).
    #[arg(
        long,
        global = true,
        env = "DLOCK_URL",
        hide_env_values = true,
        value_name = "URL"
    )]
    pub(crate) url: Option<String>,

    /// Log what dlock and the lock library do, on stderr (filter with RUST_LOG).
    #[arg(long, short, global = true)]
    pub(crate) verbose: bool,

    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Take the lock, run the command while keeping it, release it when the command exits,
    /// and exit with the command's status.
    ///
    /// The command gets DLOCK_KEY, DLOCK_TOKEN (the fencing token, larger than any earlier
    /// one for the key) and DLOCK_OWNER in its environment, and none of dlock's own
    /// descriptors (no database connection). SIGINT, SIGTERM and SIGHUP are passed on to it
    /// (to its whole process group unless dlock runs in a terminal's foreground), and the
    /// lock is released once it, and whatever it left in its process group, has exited. If
    /// the lock is lost while it runs
    /// (a lease that could not be renewed, a row removed by `release --force`), the command
    /// gets SIGTERM (SIGKILL after --kill-after) and dlock exits 1. If dlock dies, even by
    /// SIGKILL, the command gets SIGKILL (Linux).
    #[command(after_help = EXIT_CODES)]
    Run(RunArgs),
    /// List every held lock: key, strategy, owner, token, acquired, expires, age.
    ///
    /// Times are the database's, in UTC. Row and lease locks are listed; for-update and
    /// advisory locks live in the server's lock manager, not in a table, and are not.
    List {
        /// One JSON array of objects instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Exit 0 if KEY is free, 1 if it is held (and print by whom).
    Status {
        /// The lock's key.
        #[arg(value_parser = parse_key)]
        key: String,
    },
    /// Remove a stuck lock (its row, and its lease if unexpired), saying what was removed.
    ///
    /// For a holder known to be dead: a live holder is not told, and finds out only at its
    /// next check. Refuses without --force.
    Release {
        /// Really remove it.
        #[arg(long)]
        force: bool,
        /// The lock's key.
        #[arg(value_parser = parse_key)]
        key: String,
    },
    /// Create or upgrade the lock tables (dlock run does it on first use).
    Migrate,
    /// Delete the rows of keys nobody holds, and say how many went.
    ///
    /// Every key ever locked keeps rows until a purge: its lease, its token counter, its
    /// kind (readers or permits of N). A purge deletes them once the key is free (a lease
    /// free or expired for at least --older-than, no reader, permit or waiter left), and
    /// also row locks past their own --stale-after, expired readers and permits, and places
    /// of waiters that died. Safe beside running locks: it deletes nothing a holder or
    /// waiter counts on, and a key's tokens keep increasing across it. for-update keys leave
    /// a row each (PostgreSQL, MySQL), deleted once nobody holds the key; advisory locks
    /// live in the server and leave nothing to purge.
    Purge {
        /// Only leases free or expired (and readers and permits expired) for at least this
        /// long, and for-update key rows made at least this long ago, e.g. 1h (default: 0s,
        /// every free one).
        #[arg(long, value_parser = parse_duration, default_value = "0s", value_name = "DURATION")]
        older_than: Duration,
    },
}

#[derive(Debug, Args)]
pub(crate) struct RunArgs {
    /// The lock's key: 1 to 255 bytes.
    #[arg(long, value_parser = parse_key)]
    pub(crate) key: String,

    /// How the lock is kept. for-update and advisory need PostgreSQL or MySQL,
    /// advisory-xact PostgreSQL.
    #[arg(long, value_enum, default_value_t = StrategyArg::Lease)]
    pub(crate) strategy: StrategyArg,

    /// Lease: how long the lock outlives a dlock that died (renewed every ttl/3 while the
    /// command runs).
    #[arg(long, value_parser = parse_duration, default_value = "30s", value_name = "DURATION")]
    pub(crate) ttl: Duration,

    /// Row: age after which another dlock may take over the row of a holder presumed dead.
    /// Without it, a crashed holder's row stays until `dlock release --force`.
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    pub(crate) stale_after: Option<Duration>,

    /// Wait this long for the lock (`forever` to wait as long as it takes).
    /// Default: a single attempt.
    #[arg(long, value_parser = parse_wait, value_name = "DURATION", conflicts_with = "no_wait")]
    pub(crate) wait: Option<Wait>,

    /// Make a single attempt (the default).
    #[arg(long)]
    pub(crate) no_wait: bool,

    /// Keep the lock at least this long after it was taken, even if the command exits
    /// sooner, so that other machines do not run it again right away. SIGINT/SIGTERM during
    /// this time release it at once.
    #[arg(long, value_parser = parse_duration, default_value = "0s", value_name = "DURATION")]
    pub(crate) min_hold: Duration,

    /// Exit 0 instead of 75 when the lock is held elsewhere (and say so only with --verbose).
    #[arg(long)]
    pub(crate) skip_ok: bool,

    /// The owner name stored with the lock. Default: host:pid:random.
    #[arg(long)]
    pub(crate) owner: Option<String>,

    /// After the lock is lost and the command was sent SIGTERM, send SIGKILL this much later
    /// (likewise to background jobs still running after the command exited).
    #[arg(long, value_parser = parse_duration, default_value = "10s", value_name = "DURATION")]
    pub(crate) kill_after: Duration,

    /// Take the key as one of many readers (a shared lock): other `--shared` runs of the key
    /// run beside this one; a plain or `--write` run of the key waits for them (or, without
    /// --wait, is refused), and they wait for it. lease (every backend), for-update
    /// (PostgreSQL, MySQL) and advisory (PostgreSQL); elsewhere exit 2.
    #[arg(long, conflicts_with_all = ["semaphore", "write"])]
    pub(crate) shared: bool,

    /// Take the key as the one writer of a reader-writer lock: the same lock as a plain run
    /// (no `--shared` run, no `--semaphore` run and no other writer holds the key meanwhile),
    /// and a waiting writer keeps new readers out.
    #[arg(long, conflicts_with = "semaphore")]
    pub(crate) write: bool,

    /// Take one of N permits of the key (a semaphore): at most N runs hold the key at once,
    /// and none while a plain or `--write` run holds it. N is fixed by the key's first run; a
    /// key is a semaphore or a reader-writer lock, never both (`--shared` on a semaphore key
    /// is an error). lease, for-update (PostgreSQL, MySQL) and advisory (PostgreSQL);
    /// elsewhere exit 2.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) semaphore: Option<u32>,

    /// The command and its arguments (after `--`).
    #[arg(required = true, trailing_var_arg = true, value_name = "CMD")]
    pub(crate) command: Vec<OsString>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum StrategyArg {
    /// Holder + expiry on the database clock, renewed while the command runs.
    Lease,
    /// A row that exists while the lock is held.
    Row,
    /// SELECT … FOR UPDATE in a transaction kept open (PostgreSQL, MySQL).
    ForUpdate,
    /// pg_advisory_lock / GET_LOCK (PostgreSQL, MySQL).
    Advisory,
    /// pg_advisory_xact_lock in a transaction kept open (PostgreSQL; works behind a
    /// transaction-pooling PgBouncer).
    AdvisoryXact,
}

#[derive(Debug, Clone, Copy)]
pub(crate) enum Wait {
    For(Duration),
    Forever,
}

/// The longest duration any option takes: 100 years of 365 days, as the library's own limit
/// on a ttl or `stale_after`. Longer ones are refused when the options are read, so that no
/// deadline computed from them can overflow.
const MAX_DURATION: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

fn parse_duration(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s)
        .map_err(|e| format!("{e} (write durations like 500ms, 30s, 5m)"))?;
    if d > MAX_DURATION {
        return Err("durations longer than 100 years (36500 days) are not supported".to_owned());
    }
    Ok(d)
}

fn parse_wait(s: &str) -> Result<Wait, String> {
    if s == "forever" {
        Ok(Wait::Forever)
    } else {
        parse_duration(s).map(Wait::For)
    }
}

fn parse_key(s: &str) -> Result<String, String> {
    if s.is_empty() {
        Err("the key is empty".into())
    } else if s.len() > diesel_lock::MAX_KEY_LEN {
        Err(format!(
            "the key is {} bytes long; at most {} are allowed",
            s.len(),
            diesel_lock::MAX_KEY_LEN
        ))
    } else {
        Ok(s.to_owned())
    }
}

/// Why dlock stops without a status of the command's: an exit code and one line for stderr.
#[derive(Debug)]
pub(crate) struct Failure {
    pub(crate) code: u8,
    pub(crate) message: String,
}

impl Failure {
    pub(crate) fn new(code: u8, message: impl Into<String>) -> Self {
        Failure {
            code,
            message: message.into(),
        }
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        let code = match e {
            Error::InvalidUrl(_)
            | Error::InvalidKey { .. }
            | Error::InvalidConfig(_)
            | Error::Unsupported { .. }
            | Error::Incompatible { .. } => EXIT_USAGE,
            _ => EXIT_RUNTIME,
        };
        Failure::new(code, chain(&e))
    }
}

impl From<io::Error> for Failure {
    fn from(e: io::Error) -> Self {
        Failure::new(EXIT_RUNTIME, e.to_string())
    }
}

/// An error and its sources on one line.
pub(crate) fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        // Some errors repeat their source's text in their own.
        if !s.contains(text.trim()) {
            s.push_str(": ");
            s.push_str(text.trim());
        }
        source = cause.source();
    }
    one_line(&s)
}

/// `text` with its line breaks and runs of white space made single spaces.
pub(crate) fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// clap's message up to its first blank line, joined into one line.
pub(crate) fn one_line_usage_error(e: &clap::Error) -> String {
    let text = e.render().to_string();
    let head: Vec<&str> = text
        .lines()
        .take_while(|l| !l.trim().is_empty())
        .map(str::trim)
        .collect();
    let line = head.join(" ");
    let line = line.strip_prefix("error: ").unwrap_or(&line);
    format!("{line} (see dlock --help)")
}

/// `now + d`, or as far as the clock goes if that cannot be represented: never a panic.
pub(crate) fn deadline_after(now: Instant, d: Duration) -> Instant {
    now.checked_add(d)
        .or_else(|| now.checked_add(MAX_DURATION))
        .unwrap_or(now)
}

pub(crate) fn round_ms(d: Duration) -> Duration {
    Duration::from_millis(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A thread the library could not start (its listener) is a runtime failure, exit 1, not
    /// a usage error (exit 2), as it was while the library reported it as `InvalidConfig`.
    #[test]
    fn a_thread_that_cannot_start_is_a_runtime_failure() {
        let f = Failure::from(Error::Thread(io::Error::other("no more threads")));
        assert_eq!(f.code, EXIT_RUNTIME);
        let f = Failure::from(Error::InvalidConfig("ttl".into()));
        assert_eq!(f.code, EXIT_USAGE);
    }
}
