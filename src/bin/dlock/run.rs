//! `dlock run`: the `Locker` built from the options, taking the lock (waiting as `--wait`
//! says, creating the tables on first use), the command started under it with
//! `DLOCK_KEY/TOKEN/OWNER`, watched and supervised until it exits, the lock released, and the
//! command's status returned. A lock held elsewhere ends it with `not_acquired`.

use crate::args::{
    chain, deadline_after, Failure, RunArgs, StrategyArg, Wait, EXIT_CANNOT_EXECUTE,
    EXIT_NOT_ACQUIRED, EXIT_NOT_FOUND, EXIT_RUNTIME, EXIT_USAGE,
};
use crate::database::Database;
use crate::job::{describe, exit_code, signal_name, Job};
use crate::supervise::{hold_at_least, lost_event, supervise, Event};
use diesel::r2d2::{ConnectionManager, Pool};
use diesel_lock::{admin, AnyConnection, Cancel, Error, LockGuard, Locker, Strategy};
use signal_hook::consts::signal::{SIGCHLD, SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::exfiltrator::WithOrigin;
use signal_hook::iterator::SignalsInfo;
use std::io;
use std::os::fd::RawFd;
use std::process::Command as ProcessCommand;
use std::sync::mpsc::{self, Receiver, Sender};
use std::time::{Duration, Instant};

fn locker(db: &Database, args: &RunArgs) -> Result<Locker<AnyConnection>, Failure> {
    // `--stale-after` belongs to the row strategy: given with another, it would be ignored
    // while the user believes a dead holder's lock to be taken over after it.
    if args.stale_after.is_some() && !matches!(args.strategy, StrategyArg::Row) {
        return Err(Failure::new(
            EXIT_USAGE,
            "--stale-after applies to --strategy row only (a lease ends after --ttl; \
             for-update and advisory end with the holder's session)"
                .to_owned(),
        ));
    }
    let strategy = match args.strategy {
        StrategyArg::Lease => Strategy::Lease { ttl: args.ttl },
        StrategyArg::Row => Strategy::Row {
            stale_after: args.stale_after,
        },
        StrategyArg::ForUpdate => Strategy::ForUpdate,
        StrategyArg::Advisory => Strategy::Advisory,
        StrategyArg::AdvisoryXact => Strategy::AdvisoryXact,
    };
    let mut builder = db.locker()?.strategy(strategy);
    if let Some(owner) = &args.owner {
        builder = builder.owner(owner.clone());
    }
    // A run that waits on PostgreSQL hears its turn come by the `Locker`'s default listener
    // (started by the wait; none through a transaction pooler, where waiters poll).
    let locker = builder.build()?;
    db.say_default();
    Ok(locker)
}

pub(crate) fn run(
    db: &Database,
    args: RunArgs,
    verbose: bool,
    inherited_fds: Vec<RawFd>,
) -> Result<u8, Failure> {
    let locker = locker(db, &args)?;
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
    let kind = match (args.shared, args.write, args.semaphore) {
        (true, _, _) => Kind::Shared,
        (_, true, _) => Kind::Write,
        (_, _, Some(n)) => Kind::Permit(n),
        _ => Kind::Exclusive,
    };
    let guard = match acquire(&locker, kind, &args.key, wait, &events, &tx)? {
        Some(guard) => guard,
        None => return Ok(not_acquired(locker.pool(), &args, verbose)),
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

    lost_event(&guard, &tx);
    let outcome = supervise(job, &events, args.kill_after);
    let outcome = match outcome {
        Ok(o) if o.lost.is_none() => hold_at_least(o, acquired, args.min_hold, &events),
        other => other,
    };
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

/// Takes the lock, waiting as `wait` says; `None` if it stayed held elsewhere. The tables
/// are created on first use. The first attempt never waits, so that a held lock is reported
/// (and logged) at once; the wait after it is ONE call, which keeps its place in line
/// throughout (in the server's lock queue for `advisory` and `for-update`), and which
/// SIGINT/SIGTERM/SIGHUP cancel.
fn acquire(
    locker: &Locker<AnyConnection>,
    kind: Kind,
    key: &str,
    wait: Wait,
    events: &Receiver<Event>,
    tx: &Sender<Event>,
) -> Result<Option<LockGuard<AnyConnection>>, Failure> {
    let deadline = match wait {
        Wait::For(d) => Some(deadline_after(Instant::now(), d)),
        Wait::Forever => None,
    };
    let mut migrated = false;
    loop {
        match kind.try_once(locker, key) {
            Ok(Some(guard)) => return Ok(Some(guard)),
            Ok(None) => break,
            Err(Error::MissingTable(_)) if !migrated => {
                log::info!("creating the lock tables");
                locker.migrate()?;
                migrated = true;
            }
            Err(e) => return Err(e.into()),
        }
    }
    if deadline.is_some_and(|d| Instant::now() >= d) {
        return Ok(None);
    }
    log::info!("{key:?} is held elsewhere; waiting for it");
    let cancel = Cancel::new();
    let (waited, interrupted) = std::thread::scope(|scope| {
        let waiter = std::thread::Builder::new()
            .name("dlock-wait".into())
            .spawn_scoped(scope, || {
                let waited = kind.wait(locker, key, deadline, &cancel);
                let _ = tx.send(Event::Waited);
                waited
            });
        let waiter = match waiter {
            Ok(w) => w,
            Err(e) => return (Err(Error::Thread(e)), None),
        };
        let mut interrupted = None;
        loop {
            match events.recv() {
                Ok(Event::Signal(origin)) if origin.signal == SIGCHLD => {}
                Ok(Event::Signal(origin)) => {
                    if interrupted.is_none() {
                        log::debug!("{}: cancelling the wait", signal_name(origin.signal));
                        interrupted = Some(origin.signal);
                        cancel.cancel();
                    }
                }
                Ok(Event::Waited) | Err(_) => break,
                Ok(Event::Lost(_)) => {}
            }
        }
        let waited = waiter
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        (waited, interrupted)
    });
    if let Some(signal) = interrupted {
        // A lock granted as the wait was cancelled has been released by the library.
        drop(waited);
        return Err(Failure::new(
            128 + signal as u8,
            format!(
                "interrupted by {} while waiting for the lock",
                signal_name(signal)
            ),
        ));
    }
    Ok(waited?)
}

/// How `dlock run` takes the key: `--shared`, `--write`, `--semaphore N`, or none.
#[derive(Debug, Clone, Copy)]
enum Kind {
    Exclusive,
    Shared,
    Write,
    Permit(u32),
}

impl Kind {
    fn try_once(
        self,
        locker: &Locker<AnyConnection>,
        key: &str,
    ) -> diesel_lock::Result<Option<LockGuard<AnyConnection>>> {
        match self {
            Kind::Exclusive => locker.try_lock(key),
            Kind::Shared => locker.try_read(key),
            Kind::Write => locker.try_write(key),
            Kind::Permit(n) => locker.try_permit(key, n),
        }
    }

    fn wait(
        self,
        locker: &Locker<AnyConnection>,
        key: &str,
        deadline: Option<Instant>,
        cancel: &Cancel,
    ) -> diesel_lock::Result<Option<LockGuard<AnyConnection>>> {
        match self {
            Kind::Exclusive => locker.try_lock_cancellable(key, deadline, cancel),
            Kind::Shared => locker.try_read_cancellable(key, deadline, cancel),
            Kind::Write => locker.try_write_cancellable(key, deadline, cancel),
            Kind::Permit(n) => locker.try_permit_cancellable(key, n, deadline, cancel),
        }
    }
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

fn release_guard(guard: LockGuard<AnyConnection>) {
    if let Err(e) = guard.release() {
        log::warn!("could not release the lock: {e}");
    }
}
