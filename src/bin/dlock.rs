//! `dlock`: run a command under a distributed lock kept in PostgreSQL, MySQL/MariaDB or
//! SQLite, and look at or clear the locks held.

use clap::{Args, Parser, Subcommand, ValueEnum};
use diesel::r2d2::{ConnectionManager, Pool};
use diesel_lock::{admin, AnyConnection, Error, LockGuard, LockInfo, Locker, Strategy};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use signal_hook::consts::signal::{SIGCHLD, SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::exfiltrator::WithOrigin;
use signal_hook::iterator::SignalsInfo;
use signal_hook::low_level::siginfo::{Cause, Origin};
use std::ffi::OsString;
use std::io::{self, Write};
use std::os::fd::RawFd;
use std::process::{Child, Command as ProcessCommand, ExitCode, ExitStatus};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

/// The child's own status is passed through; these are dlock's.
const EXIT_RUNTIME: u8 = 1;
const EXIT_USAGE: u8 = 2;
const EXIT_NOT_ACQUIRED: u8 = 75; // EX_TEMPFAIL, as `flock -E 75` would
const EXIT_CANNOT_EXECUTE: u8 = 126;
const EXIT_NOT_FOUND: u8 = 127;

const EXIT_CODES: &str = "\
Exit codes:
  0    success (run: the command exited 0; status: the key is free)
  N    run: the command's own exit status; 128+S if it was killed by signal S
  1    runtime error (database unreachable, lock lost while the command ran, ...);
       status: the key is held
  2    usage error (bad option, duration, key or URL; strategy the backend lacks)
  75   run: the lock is held elsewhere and was not acquired (0 with --skip-ok)
  126  run: the command could not be executed
  127  run: the command was not found
  130/143  run: interrupted by SIGINT/SIGTERM while waiting for the lock

Environment:
  DLOCK_URL   the database URL when --url is not given
  RUST_LOG    log filter for --verbose (default: debug)";

/// Runs a command under a distributed lock kept in PostgreSQL, MySQL/MariaDB or SQLite.
#[derive(Debug, Parser)]
#[command(name = "dlock", version, after_help = EXIT_CODES)]
struct Cli {
    /// Database: postgres://…, mysql://…, sqlite://PATH or a plain file path (SQLite).
    /// Passwords in it are never printed.
    #[arg(
        long,
        global = true,
        env = "DLOCK_URL",
        hide_env_values = true,
        default_value = "sqlite://dlock.db",
        value_name = "URL"
    )]
    url: String,

    /// Log what dlock and the lock library do, on stderr (filter with RUST_LOG).
    #[arg(long, short, global = true)]
    verbose: bool,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
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
}

#[derive(Debug, Args)]
struct RunArgs {
    /// The lock's key: 1 to 255 bytes.
    #[arg(long, value_parser = parse_key)]
    key: String,

    /// How the lock is kept. for-update and advisory need PostgreSQL or MySQL.
    #[arg(long, value_enum, default_value_t = StrategyArg::Lease)]
    strategy: StrategyArg,

    /// Lease: how long the lock outlives a dlock that died (renewed every ttl/3 while the
    /// command runs).
    #[arg(long, value_parser = parse_duration, default_value = "30s", value_name = "DURATION")]
    ttl: Duration,

    /// Row: age after which another dlock may take over the row of a holder presumed dead.
    /// Without it, a crashed holder's row stays until `dlock release --force`.
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    stale_after: Option<Duration>,

    /// Wait this long for the lock (`forever` to wait as long as it takes).
    /// Default: a single attempt.
    #[arg(long, value_parser = parse_wait, value_name = "DURATION", conflicts_with = "no_wait")]
    wait: Option<Wait>,

    /// Make a single attempt (the default).
    #[arg(long)]
    no_wait: bool,

    /// Keep the lock at least this long after it was taken, even if the command exits
    /// sooner, so that other machines do not run it again right away. SIGINT/SIGTERM during
    /// this time release it at once.
    #[arg(long, value_parser = parse_duration, default_value = "0s", value_name = "DURATION")]
    min_hold: Duration,

    /// Exit 0 instead of 75 when the lock is held elsewhere (and say so only with --verbose).
    #[arg(long)]
    skip_ok: bool,

    /// The owner name stored with the lock. Default: host:pid:random.
    #[arg(long)]
    owner: Option<String>,

    /// After the lock is lost and the command was sent SIGTERM, send SIGKILL this much later
    /// (likewise to background jobs still running after the command exited).
    #[arg(long, value_parser = parse_duration, default_value = "10s", value_name = "DURATION")]
    kill_after: Duration,

    /// The command and its arguments (after `--`).
    #[arg(required = true, trailing_var_arg = true, value_name = "CMD")]
    command: Vec<OsString>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum StrategyArg {
    /// Holder + expiry on the database clock, renewed while the command runs.
    Lease,
    /// A row that exists while the lock is held.
    Row,
    /// SELECT … FOR UPDATE in a transaction kept open (PostgreSQL, MySQL).
    ForUpdate,
    /// pg_advisory_lock / GET_LOCK (PostgreSQL, MySQL).
    Advisory,
}

#[derive(Debug, Clone, Copy)]
enum Wait {
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
struct Failure {
    code: u8,
    message: String,
}

impl Failure {
    fn new(code: u8, message: impl Into<String>) -> Self {
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
            | Error::Unsupported { .. } => EXIT_USAGE,
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
fn chain(e: &dyn std::error::Error) -> String {
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
fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The database URL as given, and its secrets, which no message may contain.
#[derive(Debug)]
struct Database {
    url: String,
    secrets: Vec<String>,
}

impl Database {
    fn new(url: String) -> Self {
        let mut secrets = Vec::new();
        if let Ok(parsed) = url::Url::parse(&url) {
            if let Some(p) = parsed.password() {
                secrets.push(p.to_owned());
                secrets.push(percent_decode(p));
            }
            for (k, v) in parsed.query_pairs() {
                if k.eq_ignore_ascii_case("password") {
                    secrets.push(v.into_owned());
                }
            }
        }
        // Very short strings would blank out ordinary words; such passwords are not looked
        // for (and no message is built from the URL unredacted in the first place).
        secrets.retain(|s| s.len() >= 4);
        Database { url, secrets }
    }

    /// The URL with its password (in the user part or a `password=` parameter) masked.
    fn redacted(&self) -> String {
        let Ok(mut parsed) = url::Url::parse(&self.url) else {
            return self.scrub(&self.url); // a plain path
        };
        if parsed.cannot_be_a_base() || parsed.scheme() == "sqlite" {
            return self.scrub(&self.url);
        }
        if parsed.password().is_some() {
            let _ = parsed.set_password(Some("***"));
        }
        if parsed
            .query_pairs()
            .any(|(k, _)| k.eq_ignore_ascii_case("password"))
        {
            let pairs: Vec<(String, String)> = parsed
                .query_pairs()
                .map(|(k, v)| {
                    let v = if k.eq_ignore_ascii_case("password") {
                        "***".to_owned()
                    } else {
                        v.into_owned()
                    };
                    (k.into_owned(), v)
                })
                .collect();
            parsed.query_pairs_mut().clear().extend_pairs(pairs);
        }
        self.scrub(parsed.as_str())
    }

    /// `text` with every secret of the URL masked.
    fn scrub(&self, text: &str) -> String {
        let mut text = text.to_owned();
        for s in &self.secrets {
            text = text.replace(s.as_str(), "***");
        }
        text
    }

    fn connect(&self) -> Result<Pool<ConnectionManager<AnyConnection>>, Failure> {
        log::info!("database: {}", self.redacted());
        diesel_lock::connect(&self.url).map_err(|e| {
            // connect() reports the driver's own reason as the error's source.
            let why = std::error::Error::source(&e).map(|s| one_line(&self.scrub(&s.to_string())));
            let mut f = Failure::from(e);
            if f.code == EXIT_RUNTIME {
                f.message = match why {
                    Some(why) => format!(
                        "could not connect to the database at {}: {why}",
                        self.redacted()
                    ),
                    None => format!("{} ({})", f.message, self.redacted()),
                };
            }
            f
        })
    }
}

/// `s` with its %-escapes decoded (a URL's password may be written either way).
fn percent_decode(s: &str) -> String {
    url::form_urlencoded::parse(format!("x={s}").as_bytes())
        .next()
        .map_or_else(|| s.to_owned(), |(_, v)| v.into_owned())
}

fn main() -> ExitCode {
    let code = main_code();
    ExitCode::from(code)
}

fn main_code() -> u8 {
    // Before anything of dlock's is opened.
    let inherited_fds = inherited_fds();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(
                e.kind(),
                ErrorKind::DisplayHelp
                    | ErrorKind::DisplayVersion
                    | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
            ) {
                let _ = e.print();
                return if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
                    EXIT_USAGE
                } else {
                    0
                };
            }
            eprintln!("dlock: {}", one_line_usage_error(&e));
            return EXIT_USAGE;
        }
    };
    env_logger::Builder::from_env(
        env_logger::Env::default().default_filter_or(if cli.verbose { "debug" } else { "off" }),
    )
    .format_timestamp_millis()
    .init();
    let db = Database::new(cli.url.clone());
    // A panic (a bug) unwinds through `run`, which kills the command and releases the lock on
    // the way, and ends dlock here; the panic message has been printed already.
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match cli.command {
        Command::Run(args) => run(&db, args, cli.verbose, inherited_fds),
        Command::List { json } => list(&db, json),
        Command::Status { key } => status(&db, &key),
        Command::Release { force, key } => release(&db, &key, force),
        Command::Migrate => migrate(&db),
    }))
    .unwrap_or_else(|_| {
        Err(Failure::new(
            EXIT_RUNTIME,
            "internal error (a bug, described above); the command was stopped and the lock released",
        ))
    });
    let code = match result {
        Ok(code) => code,
        Err(f) => {
            eprintln!("dlock: {}", db.scrub(&f.message));
            f.code
        }
    };
    let _ = io::stdout().flush();
    let _ = io::stderr().flush();
    // Leave without running the C library's exit handlers: r2d2 may still be opening a
    // connection in a background thread (to refill the pool), and with PostgreSQL over TLS
    // OpenSSL's exit handler frees the state that handshake is using: a segfault in about one
    // exit in ten. Nothing of ours is left to clean up at this point: every guard has been
    // released and all output flushed.
    signal_hook::low_level::exit(i32::from(code))
}

/// clap's message up to its first blank line, joined into one line.
fn one_line_usage_error(e: &clap::Error) -> String {
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

fn locker(
    db: &Database,
    args: &RunArgs,
) -> Result<
    (
        Locker<AnyConnection>,
        Pool<ConnectionManager<AnyConnection>>,
    ),
    Failure,
> {
    let strategy = match args.strategy {
        StrategyArg::Lease => Strategy::Lease { ttl: args.ttl },
        StrategyArg::Row => Strategy::Row {
            stale_after: args.stale_after,
        },
        StrategyArg::ForUpdate => Strategy::ForUpdate,
        StrategyArg::Advisory => Strategy::Advisory,
    };
    let pool = db.connect()?;
    let mut builder = Locker::builder(pool.clone()).strategy(strategy);
    if let Some(owner) = &args.owner {
        builder = builder.owner(owner.clone());
    }
    // A run that waits on PostgreSQL listens for releases, so it starts the moment the holder
    // (another dlock, another machine) releases instead of at its next poll.
    let url = db.url.trim();
    if args.wait.is_some()
        && !args.no_wait
        && (url.starts_with("postgres://") || url.starts_with("postgresql://"))
    {
        builder = builder.listen_url(url.to_owned());
    }
    Ok((builder.build()?, pool))
}

/// What the signal thread and the lock watcher tell the main thread.
#[derive(Debug)]
enum Event {
    Signal(Origin),
    Lost(String),
}

fn run(
    db: &Database,
    args: RunArgs,
    verbose: bool,
    inherited_fds: Vec<RawFd>,
) -> Result<u8, Failure> {
    let (locker, pool) = locker(db, &args)?;
    // From here on SIGINT/SIGTERM no longer end dlock by themselves: they are read from this
    // channel, so a lock taken at that moment is still released.
    let (tx, events) = mpsc::channel();
    let mut signals = SignalsInfo::<WithOrigin>::new([SIGINT, SIGTERM, SIGHUP, SIGCHLD])?;
    let signal_tx = tx.clone();
    std::thread::Builder::new()
        .name("dlock-signals".into())
        .spawn(move || {
            for origin in signals.forever() {
                if signal_tx.send(Event::Signal(origin)).is_err() {
                    break;
                }
            }
        })?;

    let wait = match (args.no_wait, args.wait) {
        (true, _) | (false, None) => Wait::For(Duration::ZERO),
        (false, Some(w)) => w,
    };
    let guard = match acquire(&locker, &args.key, wait, &events)? {
        Some(guard) => guard,
        None => return Ok(not_acquired(&pool, &args, verbose)),
    };
    let acquired = Instant::now();
    log::info!(
        "lock {:?} acquired ({}, token {}, owner {:?})",
        guard.key(),
        locker.strategy().name(),
        guard.token(),
        guard.owner()
    );

    // The command's background jobs whose parent exits become dlock's children rather than
    // init's, so that dlock can tell when they have all ended (`Job::stop_leftovers`).
    #[cfg(any(target_os = "linux", target_os = "android"))]
    // SAFETY: a plain system call with integer arguments.
    unsafe {
        libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
    }
    let mut command = ProcessCommand::new(&args.command[0]);
    command
        .args(&args.command[1..])
        .env("DLOCK_KEY", guard.key())
        .env("DLOCK_TOKEN", guard.token().to_string())
        .env("DLOCK_OWNER", guard.owner());
    let job = match Job::spawn(command, inherited_fds) {
        Ok(job) => job,
        Err(e) => {
            let code = match e.kind() {
                io::ErrorKind::NotFound => EXIT_NOT_FOUND,
                io::ErrorKind::PermissionDenied => EXIT_CANNOT_EXECUTE,
                _ => EXIT_RUNTIME,
            };
            let name = args.command[0].to_string_lossy();
            release_guard(guard);
            return Err(Failure::new(code, format!("cannot run {name:?}: {e}")));
        }
    };
    log::debug!(
        "command started, pid {}{}",
        job.child.id(),
        if job.own_group {
            " (in a process group of its own)"
        } else {
            " (in dlock's process group, which has the terminal)"
        }
    );

    let (check_every, give_up_after) = match locker.strategy() {
        // Renewals also happen every ttl/3; a watcher that cannot reach the database for a
        // whole ttl must assume the lease has run out.
        Strategy::Lease { ttl } => (ttl / 3, Some(ttl)),
        Strategy::Row {
            stale_after: Some(s),
        } => ((s / 3).min(Duration::from_secs(5)), None),
        // Session strategies: a cheap query on the session that holds the lock; a session
        // ended by the server is noticed within a second.
        Strategy::ForUpdate | Strategy::Advisory => (Duration::from_secs(1), None),
        _ => (Duration::from_secs(5), None),
    };
    let outcome = std::thread::scope(|scope| {
        // Owned by this closure, so that a panic below drops it while unwinding: the watcher
        // then stops, the scope ends, and the panic reaches main instead of waiting here for
        // ever (with the lease renewed all the while).
        let (stop_tx, stop_rx) = mpsc::channel::<()>();
        let guard = &guard;
        let lost_tx = tx.clone();
        scope.spawn(move || watch(guard, check_every, give_up_after, &stop_rx, &lost_tx));
        let outcome = supervise(job, &events, args.kill_after);
        let outcome = match outcome {
            Ok(o) if o.lost.is_none() => hold_at_least(o, acquired, args.min_hold, &events),
            other => other,
        };
        let _ = stop_tx.send(());
        outcome
    });
    let outcome = outcome?;
    if let Some(why) = outcome.lost {
        drop(guard); // nothing of ours left to release; Drop logs what it finds
        log::debug!("{why}");
        return Err(Failure::new(
            EXIT_RUNTIME,
            format!(
                "the command was stopped because the lock on {:?} was lost ({})",
                args.key,
                describe(outcome.status)
            ),
        ));
    }
    match guard.release() {
        Ok(()) => {}
        Err(Error::LockLost { .. }) if outcome.lost_after_command => {}
        Err(Error::LockLost { key }) => {
            return Err(Failure::new(
                EXIT_RUNTIME,
                format!(
                    "the lock on {key:?} was lost before the command finished ({})",
                    describe(outcome.status)
                ),
            ));
        }
        Err(e) => eprintln!(
            "dlock: warning: could not release the lock: {} (a lease frees itself after its ttl; a row needs `dlock release --force`)",
            db.scrub(&chain(&e))
        ),
    }
    Ok(exit_code(outcome.status))
}

/// Takes the lock, waiting as `wait` says; `None` if it stayed held elsewhere. Waiting is
/// done in short slices so that SIGINT/SIGTERM end it promptly, and the tables are created
/// on first use.
fn acquire(
    locker: &Locker<AnyConnection>,
    key: &str,
    wait: Wait,
    events: &Receiver<Event>,
) -> Result<Option<LockGuard<AnyConnection>>, Failure> {
    const SLICE: Duration = Duration::from_millis(200);
    let deadline = match wait {
        Wait::For(d) => Some(deadline_after(Instant::now(), d)),
        Wait::Forever => None,
    };
    let mut migrated = false;
    let mut first = true;
    loop {
        while let Ok(event) = events.try_recv() {
            if let Event::Signal(origin) = event {
                if origin.signal != SIGCHLD {
                    return Err(Failure::new(
                        128 + origin.signal as u8,
                        format!(
                            "interrupted by {} while waiting for the lock",
                            signal_name(origin.signal)
                        ),
                    ));
                }
            }
        }
        let left = deadline.map_or(SLICE, |d| {
            d.saturating_duration_since(Instant::now()).min(SLICE)
        });
        // The first attempt never waits, so that a held lock is reported (and logged) at once.
        let attempt = if first || left.is_zero() {
            locker.try_lock(key)
        } else {
            locker.try_lock_for(key, left)
        };
        match attempt {
            Ok(Some(guard)) => return Ok(Some(guard)),
            Ok(None) if deadline.is_some_and(|d| Instant::now() >= d) => return Ok(None),
            Ok(None) => {
                if first {
                    log::info!("{key:?} is held elsewhere; waiting for it");
                }
                first = false;
            }
            Err(Error::MissingTable(_)) if !migrated => {
                log::info!("creating the lock tables");
                locker.migrate()?;
                migrated = true;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// `now + d`, or as far as the clock goes if that cannot be represented: never a panic.
fn deadline_after(now: Instant, d: Duration) -> Instant {
    now.checked_add(d)
        .or_else(|| now.checked_add(MAX_DURATION))
        .unwrap_or(now)
}

/// The one line printed when the lock is held elsewhere, and the exit code.
fn not_acquired(
    pool: &Pool<ConnectionManager<AnyConnection>>,
    args: &RunArgs,
    verbose: bool,
) -> u8 {
    let holder = pool
        .get()
        .ok()
        .and_then(|mut c| admin::lock_info(&mut *c, &args.key).ok())
        .and_then(|held| held.into_iter().next())
        .map(|i| format!(" by {:?} (token {})", i.owner, i.token))
        .unwrap_or_default();
    let message = format!(
        "dlock: {:?} is held{holder}; not running the command",
        args.key
    );
    if args.skip_ok {
        if verbose {
            eprintln!("{message}");
        }
        0
    } else {
        eprintln!("{message}");
        EXIT_NOT_ACQUIRED
    }
}

/// Checks the lock every `every` until told to stop; reports a loss on `tx`.
fn watch(
    guard: &LockGuard<AnyConnection>,
    every: Duration,
    give_up_after: Option<Duration>,
    stop: &Receiver<()>,
    tx: &Sender<Event>,
) {
    let every = every.max(Duration::from_millis(10));
    let mut confirmed = Instant::now();
    loop {
        match stop.recv_timeout(every) {
            Err(RecvTimeoutError::Timeout) => {}
            _ => return,
        }
        match guard.check() {
            Ok(()) => confirmed = Instant::now(),
            Err(Error::LockLost { key }) => {
                let _ = tx.send(Event::Lost(format!(
                    "the lock on {key:?} was lost while the command ran (a lease that expired, a row past --stale-after, a session ended by the server, or `dlock release --force`)"
                )));
                return;
            }
            Err(e) => {
                log::warn!("could not check the lock: {e}");
                if give_up_after.is_some_and(|g| confirmed.elapsed() >= g) {
                    let _ = tx.send(Event::Lost(format!(
                        "the lock on {:?} could not be confirmed for a whole ttl ({}) and must be presumed lost",
                        guard.key(),
                        chain(&e)
                    )));
                    return;
                }
            }
        }
    }
}

#[derive(Debug)]
struct Outcome {
    status: ExitStatus,
    /// Why the lock was lost, if it was.
    lost: Option<String>,
    /// A SIGINT/SIGTERM/SIGHUP received.
    interrupted: bool,
    /// The lock was lost during `--min-hold`, after the command had finished: that only
    /// shortens the hold.
    lost_after_command: bool,
}

/// Waits for the command, passing on signals and stopping it if the lock is lost; then
/// stops whatever it left running in its process group.
fn supervise(
    mut job: Job,
    events: &Receiver<Event>,
    kill_after: Duration,
) -> Result<Outcome, Failure> {
    // SIGCHLD wakes us when the child exits; the timeout is only a safety net.
    const POLL: Duration = Duration::from_secs(1);
    let mut lost: Option<String> = None;
    let mut interrupted = false;
    let mut kill_at: Option<Instant> = None;
    loop {
        let timeout = kill_at.map_or(POLL, |t| {
            t.saturating_duration_since(Instant::now()).min(POLL)
        });
        match events.recv_timeout(timeout) {
            Ok(Event::Signal(origin)) if origin.signal == SIGCHLD => {}
            Ok(Event::Signal(origin)) => {
                interrupted = true;
                // In dlock's own process group, the command has had a terminal's Ctrl-C
                // (sent by the kernel to the whole foreground process group) already; anything
                // else is passed on, to its whole process group when it has one.
                if job.own_group || origin.cause != Cause::Kernel {
                    if let Ok(sig) = Signal::try_from(origin.signal) {
                        log::debug!("passing {sig} on to the command");
                        job.signal(sig);
                    }
                }
            }
            Ok(Event::Lost(why)) => {
                if lost.is_none() {
                    eprintln!("dlock: {why}; sending SIGTERM to the command");
                    job.signal(Signal::SIGTERM);
                    kill_at = Some(deadline_after(Instant::now(), kill_after));
                    lost = Some(why);
                }
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => {}
        }
        if let Some(status) = job.child.try_wait()? {
            job.reaped = true;
            job.stop_leftovers(kill_after);
            job.disarm();
            return Ok(Outcome {
                status,
                lost,
                interrupted,
                lost_after_command: false,
            });
        }
        if kill_at.is_some_and(|t| Instant::now() >= t) {
            eprintln!("dlock: the command did not stop after SIGTERM; sending SIGKILL");
            job.signal(Signal::SIGKILL);
            kill_at = None;
        }
    }
}

/// The running command. Dropped before it was reaped (an error or a panic in dlock), it is
/// killed, with its process group.
struct Job {
    child: Child,
    /// The command leads a process group of its own (pgid = its pid).
    own_group: bool,
    reaped: bool,
    /// With a group of its own: the process that kills the group should dlock die.
    guardian: Option<Guardian>,
}

/// A small `sh` in a process group of its own that kills the command's process group when
/// dlock dies, however it dies: it reads the group's id, then waits on a pipe whose only
/// writer is dlock. End of file (dlock gone) means SIGKILL to the whole group: the parent-
/// death signal reaches only the command itself, not what a shell command runs in its
/// foreground. dlock says "done" once the group is empty, and the guardian just exits.
struct Guardian {
    child: Child,
    pipe: std::process::ChildStdin,
}

/// The guardian's script (POSIX sh: dash's `kill` takes a negative pid only after `-s` and
/// `--`). The group's id comes through the pipe, never through the text.
const GUARDIAN: &str = "trap '' INT HUP TERM QUIT; \
    read g || exit 0; \
    read _ && exit 0; \
    kill -s KILL -- \"-$g\" 2>/dev/null";

impl Guardian {
    /// Starts the guardian, with no descriptor of dlock's but its pipe (as for the command).
    fn start(keep: &[RawFd]) -> io::Result<Guardian> {
        use std::os::unix::process::CommandExt;
        use std::process::Stdio;
        let mut sh = ProcessCommand::new("/bin/sh");
        sh.args(["-c", GUARDIAN])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0);
        let keep = keep.to_vec();
        // SAFETY: as for the command's pre_exec below: async-signal-safe system calls only.
        unsafe {
            sh.pre_exec(move || {
                cloexec_all_but(&keep);
                Ok(())
            });
        }
        let mut child = sh.spawn()?;
        let pipe = child.stdin.take().expect("piped stdin");
        Ok(Guardian { child, pipe })
    }

    /// Tells it which group to kill should dlock die.
    fn watch(&mut self, group: u32) -> io::Result<()> {
        writeln!(self.pipe, "{group}")
    }

    /// The group is empty: the guardian exits without killing anything.
    fn disarm(mut self) {
        let _ = writeln!(self.pipe, "done");
        drop(self.pipe);
        let _ = self.child.wait();
    }
}

impl Job {
    /// Starts the command so that it cannot outlive dlock and holds nothing of dlock's:
    ///
    /// - it gets SIGKILL when dlock dies, however dlock dies (Linux: `PR_SET_PDEATHSIG`;
    ///   it is tied to the thread that forks, so this must be the main thread, which lives
    ///   as long as dlock);
    /// - unless dlock has the terminal (then the command must share its process group to
    ///   read the terminal and get its Ctrl-C and Ctrl-Z), it leads a process group of its
    ///   own, so that the signals dlock passes on, and the SIGTERM/SIGKILL of a lost lock,
    ///   reach its children too;
    /// - no descriptor of dlock's reaches it: every descriptor above stderr is made
    ///   close-on-exec, except those dlock itself inherited (a make jobserver, sockets
    ///   passed by systemd), which pass through as they would without dlock. A database
    ///   socket left open in the command (libmariadb opens its sockets without
    ///   close-on-exec) would keep dlock's session, and a session lock with it, alive for
    ///   as long as the command or any background job of it runs.
    fn spawn(mut command: ProcessCommand, inherited_fds: Vec<RawFd>) -> io::Result<Job> {
        use std::os::unix::process::CommandExt;
        let own_group = !has_the_terminal();
        if own_group {
            command.process_group(0);
        }
        let parent = libc_pid(std::process::id());
        let mut keep = inherited_fds;
        keep.retain(|&fd| fd > 2);
        keep.sort_unstable();
        keep.dedup();
        // Started first, so that no moment of the command's life goes unguarded.
        let mut guardian = if own_group {
            Some(Guardian::start(&keep)?)
        } else {
            None
        };
        // SAFETY: the closure runs in the child between fork and exec, and only makes
        // async-signal-safe system calls (prctl, getppid, close_range or fcntl, getrlimit,
        // _exit) on memory allocated before the fork; it allocates nothing, takes no lock.
        unsafe {
            command.pre_exec(move || {
                #[cfg(any(target_os = "linux", target_os = "android"))]
                {
                    if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                        return Err(io::Error::last_os_error());
                    }
                }
                // dlock may have died before the line above: then nobody would ever send
                // the signal.
                if libc::getppid() != parent {
                    libc::_exit(i32::from(EXIT_RUNTIME));
                }
                cloexec_all_but(&keep);
                Ok(())
            });
        }
        let child = command.spawn()?;
        if let Some(g) = &mut guardian {
            if let Err(e) = g.watch(child.id()) {
                log::warn!("the guardian of the command's process group is gone: {e}");
            }
        }
        Ok(Job {
            child,
            own_group,
            reaped: false,
            guardian,
        })
    }

    /// The command's group is empty: its guardian may go.
    fn disarm(&mut self) {
        if let Some(g) = self.guardian.take() {
            g.disarm();
        }
    }

    /// Sends `sig` to the command, and to its whole process group when it has its own.
    fn signal(&self, sig: Signal) {
        if self.reaped && !self.own_group {
            return; // its pid may belong to another process by now
        }
        let pid = Pid::from_raw(libc_pid(self.child.id()));
        let target = if self.own_group {
            Pid::from_raw(-pid.as_raw())
        } else {
            pid
        };
        let _ = kill(target, sig);
    }

    /// After the command exited: its background jobs left in its process group would run on
    /// without the lock, so they get SIGTERM, and SIGKILL if still there after `kill_after`.
    /// (A job that left the group, with `setsid` for instance, is not followed.)
    fn stop_leftovers(&self, kill_after: Duration) {
        if !self.own_group {
            return;
        }
        let group = Pid::from_raw(-libc_pid(self.child.id()));
        if kill(group, Signal::SIGTERM).is_err() {
            return; // nothing left
        }
        log::info!("the command exited; sent SIGTERM to what it left in its process group");
        let deadline = deadline_after(Instant::now(), kill_after);
        let mut pause = Duration::from_millis(1);
        // dlock is their subreaper (see `run`): those whose parent has exited are its
        // children now, and reaped here, so that no zombie keeps the group in existence.
        // Nothing else tells when the group is empty.
        while {
            reap_group(group);
            kill(group, None).is_ok()
        } {
            if Instant::now() >= deadline {
                eprintln!("dlock: the command's background jobs did not stop after SIGTERM; sending SIGKILL");
                let _ = kill(group, Signal::SIGKILL);
                return;
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(50));
        }
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        if !self.reaped {
            self.signal(Signal::SIGKILL);
            let _ = self.child.wait();
        }
        self.disarm();
    }
}

/// Marks every descriptor above stderr close-on-exec but those in `keep` (sorted). Runs
/// between fork and exec: system calls only.
unsafe fn cloexec_all_but(keep: &[RawFd]) {
    let mut from: libc::c_int = 3;
    for &fd in keep {
        if fd > from {
            set_cloexec(from, fd - 1);
        }
        from = fd.saturating_add(1);
    }
    set_cloexec(from, libc::c_int::MAX);
}

/// Reaps the children of dlock's in process group `-group` that have exited (never the
/// command itself, reaped already).
fn reap_group(group: Pid) {
    let mut status = 0;
    // SAFETY: waitpid writes only to `status`.
    while unsafe { libc::waitpid(group.as_raw(), &mut status, libc::WNOHANG) } > 0 {}
}

/// Whether dlock's process group is the foreground group of the terminal on its stdin
/// (dlock was started from a shell prompt, not in the background, not by cron).
fn has_the_terminal() -> bool {
    // SAFETY: plain system calls on a descriptor number; no memory is passed.
    unsafe { libc::isatty(0) == 1 && libc::tcgetpgrp(0) == libc::getpgrp() }
}

fn libc_pid(pid: u32) -> libc::pid_t {
    libc::pid_t::try_from(pid).unwrap_or(libc::pid_t::MAX)
}

/// The descriptors above stderr open when dlock started, before it opened any of its own:
/// those pass through to the command.
fn inherited_fds() -> Vec<RawFd> {
    let listed: Vec<RawFd> = std::fs::read_dir("/dev/fd")
        .or_else(|_| std::fs::read_dir("/proc/self/fd"))
        .map(|dir| {
            dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    // The listing saw its own directory's descriptor, closed by now; and descriptors that are
    // close-on-exec already would not reach the command anyway.
    listed
        .into_iter()
        .filter(|&fd| {
            // SAFETY: F_GETFD only reads the flags of a descriptor number.
            let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
            fd > 2 && flags >= 0 && flags & libc::FD_CLOEXEC == 0
        })
        .collect()
}

/// Marks descriptors `from..=to` close-on-exec. Runs between fork and exec: system calls only.
unsafe fn set_cloexec(from: libc::c_int, to: libc::c_int) {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        // Linux 5.11 and later do it in one call.
        let done = libc::syscall(
            libc::SYS_close_range,
            from as libc::c_uint,
            to as libc::c_uint,
            libc::CLOSE_RANGE_CLOEXEC,
        ) == 0;
        if done {
            return;
        }
    }
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    let last = if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 {
        libc::c_int::try_from(limit.rlim_cur.saturating_sub(1)).unwrap_or(libc::c_int::MAX)
    } else {
        1023
    };
    let mut fd = from;
    while fd <= to.min(last) {
        let flags = libc::fcntl(fd, libc::F_GETFD);
        if flags >= 0 && flags & libc::FD_CLOEXEC == 0 {
            libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC);
        }
        fd += 1;
    }
}

/// `--min-hold`: keeps the lock until `min_hold` after it was taken, unless interrupted or
/// the lock is lost meanwhile.
fn hold_at_least(
    mut outcome: Outcome,
    acquired: Instant,
    min_hold: Duration,
    events: &Receiver<Event>,
) -> Result<Outcome, Failure> {
    let until = deadline_after(acquired, min_hold);
    if outcome.interrupted || Instant::now() >= until {
        return Ok(outcome);
    }
    log::info!(
        "holding the lock for {} more (--min-hold)",
        humantime::format_duration(round_ms(until.saturating_duration_since(Instant::now())))
    );
    loop {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(outcome);
        }
        match events.recv_timeout(left) {
            Ok(Event::Signal(origin)) if origin.signal == SIGCHLD => {}
            Ok(Event::Signal(origin)) => {
                log::info!(
                    "{} during --min-hold: releasing now",
                    signal_name(origin.signal)
                );
                return Ok(outcome);
            }
            Ok(Event::Lost(why)) => {
                // The command is done; losing the lock now only shortens the hold.
                log::warn!("{why} (during --min-hold, after the command finished)");
                outcome.lost_after_command = true;
                return Ok(outcome);
            }
            Err(_) => {}
        }
    }
}

fn release_guard(guard: LockGuard<AnyConnection>) {
    if let Err(e) = guard.release() {
        log::warn!("could not release the lock: {e}");
    }
}

fn exit_code(status: ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => u8::try_from(code & 0xff).unwrap_or(EXIT_RUNTIME),
        (None, Some(sig)) => 128u8.saturating_add(u8::try_from(sig).unwrap_or(0)),
        (None, None) => EXIT_RUNTIME,
    }
}

fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("it exited with status {code}"),
        (None, Some(sig)) => format!("it was killed by {}", signal_name(sig)),
        (None, None) => status.to_string(),
    }
}

fn signal_name(sig: i32) -> String {
    signal_hook::low_level::signal_name(sig)
        .map(str::to_owned)
        .unwrap_or_else(|| format!("signal {sig}"))
}

fn round_ms(d: Duration) -> Duration {
    Duration::from_millis(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The held locks, of every key or of one; a database without the tables holds none.
fn held_locks(db: &Database, key: Option<&str>) -> Result<Vec<LockInfo>, Failure> {
    let pool = db.connect()?;
    let mut conn = pool.get().map_err(Error::from)?;
    let result = match key {
        None => admin::held_locks(&mut *conn),
        Some(key) => admin::lock_info(&mut *conn, key),
    };
    match result {
        Ok(v) => Ok(v),
        Err(Error::MissingTable(_)) => Ok(Vec::new()),
        Err(e) => Err(e.into()),
    }
}

fn time(t: chrono::DateTime<chrono::Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S%.3f").to_string()
}

fn age(d: Duration) -> String {
    let d = if d >= Duration::from_secs(1) {
        Duration::from_secs(d.as_secs())
    } else {
        round_ms(d)
    };
    humantime::format_duration(d).to_string()
}

/// Writes to stdout; a closed pipe (`dlock list | head`) is not an error.
fn output(text: &str) -> Result<(), Failure> {
    match io::stdout().lock().write_all(text.as_bytes()) {
        Err(e) if e.kind() != io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}

fn list(db: &Database, json: bool) -> Result<u8, Failure> {
    let held = held_locks(db, None)?;
    if json {
        let rows: Vec<serde_json::Value> = held
            .iter()
            .map(|i| {
                serde_json::json!({
                    "key": i.key,
                    "strategy": i.strategy,
                    "owner": i.owner,
                    "token": i.token,
                    "acquired_at": i.acquired_at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
                    "expires_at": i.expires_at.map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Micros, true)),
                    "age_seconds": i.age().as_secs_f64(),
                })
            })
            .collect();
        let text =
            serde_json::to_string_pretty(&rows).map_err(|e| Failure::new(1, e.to_string()))?;
        return output(&format!("{text}\n")).map(|()| 0);
    }
    if held.is_empty() {
        return output("no locks held\n").map(|()| 0);
    }
    let header = [
        "KEY",
        "STRATEGY",
        "OWNER",
        "TOKEN",
        "ACQUIRED (UTC)",
        "EXPIRES (UTC)",
        "AGE",
    ]
    .map(str::to_owned);
    let rows: Vec<[String; 7]> = held
        .iter()
        .map(|i| {
            [
                i.key.clone(),
                i.strategy.to_owned(),
                i.owner.clone(),
                i.token.to_string(),
                time(i.acquired_at),
                i.expires_at.map_or_else(|| "-".to_owned(), time),
                age(i.age()),
            ]
        })
        .collect();
    let mut widths = header.clone().map(|h| h.chars().count());
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut text = String::new();
    for row in std::iter::once(&header).chain(&rows) {
        let cells: Vec<String> = row
            .iter()
            .zip(widths)
            .map(|(cell, w)| format!("{cell:<w$}"))
            .collect();
        text.push_str(cells.join("  ").trim_end());
        text.push('\n');
    }
    output(&text).map(|()| 0)
}

fn describe_holder(i: &LockInfo) -> String {
    let expires = match i.remaining() {
        Some(left) => format!(", expires in {}", age(left)),
        None => String::new(),
    };
    format!(
        "{:?} ({}, token {}, since {} UTC, {} ago{expires})",
        i.owner,
        i.strategy,
        i.token,
        time(i.acquired_at),
        age(i.age())
    )
}

fn status(db: &Database, key: &str) -> Result<u8, Failure> {
    let held = held_locks(db, Some(key))?;
    if held.is_empty() {
        output(&format!("{key:?} is free\n"))?;
        return Ok(0);
    }
    let mut text = String::new();
    for i in &held {
        text.push_str(&format!("{key:?} is held by {}\n", describe_holder(i)));
    }
    output(&text)?;
    Ok(1)
}

fn release(db: &Database, key: &str, force: bool) -> Result<u8, Failure> {
    if !force {
        return Err(Failure::new(
            EXIT_USAGE,
            format!("refusing to remove the lock on {key:?} without --force: its holder may be alive (see `dlock status {key}`)"),
        ));
    }
    let pool = db.connect()?;
    let mut conn = pool.get().map_err(Error::from)?;
    let removed = match admin::force_release(&mut *conn, key) {
        Err(Error::MissingTable(_)) => Vec::new(),
        other => other?,
    };
    if removed.is_empty() {
        output(&format!("{key:?} was not held; nothing removed\n"))?;
    }
    for i in &removed {
        output(&format!(
            "removed the {} lock on {key:?} held by {}\n",
            i.strategy,
            describe_holder(i)
        ))?;
    }
    Ok(0)
}

fn migrate(db: &Database) -> Result<u8, Failure> {
    let pool = db.connect()?;
    let locker = Locker::builder(pool).build()?;
    locker.migrate()?;
    output(&format!(
        "the lock tables are up to date ({})\n",
        locker.backend().name()
    ))?;
    Ok(0)
}
