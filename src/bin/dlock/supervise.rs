//! While the command of `dlock run` runs: the events the signal thread and the guard's loss
//! notification (`LockGuard::on_lost`, see `lost_event`) send, the loop that waits for the
//! command, passes signals on and stops it if the lock is lost (`supervise`), and
//! `--min-hold` (`hold_at_least`).

use crate::args::{deadline_after, round_ms, Failure};
use crate::job::{signal_name, Job};
use diesel_lock::{AnyConnection, LockGuard};
use nix::sys::signal::Signal;
use signal_hook::consts::signal::SIGCHLD;
use signal_hook::low_level::siginfo::{Cause, Origin};
use std::process::ExitStatus;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

/// What the signal thread and the lock watcher tell the main thread.
#[derive(Debug)]
pub(crate) enum Event {
    Signal(Origin),
    Lost(String),
    /// The wait for the lock has ended (with the lock or without).
    Waited,
}

/// Has a loss of `guard`'s lock sent on `tx` as `Event::Lost`, by the library the moment it
/// learns of it (the lease heartbeat or deadline; for the other strategies, a query once a
/// second), with no polling of ours.
pub(crate) fn lost_event(guard: &LockGuard<AnyConnection>, tx: &Sender<Event>) {
    let (tx, key) = (tx.clone(), guard.key().to_owned());
    guard.on_lost(move || {
        let _ = tx.send(Event::Lost(format!(
            "the lock on {key:?} was lost while the command ran (a lease that expired or could not be renewed in time, a row past --stale-after, a session ended by the server, or `dlock release --force`)"
        )));
    });
}

#[derive(Debug)]
pub(crate) struct Outcome {
    pub(crate) status: ExitStatus,
    /// Why the lock was lost, if it was.
    pub(crate) lost: Option<String>,
    /// A SIGINT/SIGTERM/SIGHUP received.
    interrupted: bool,
    /// The lock was lost during `--min-hold`, after the command had finished: that only
    /// shortens the hold.
    pub(crate) lost_after_command: bool,
}

/// Waits for the command, passing on signals and stopping it if the lock is lost; then
/// stops whatever it left running in its process group.
pub(crate) fn supervise(
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
            Ok(Event::Waited) => {}
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

/// `--min-hold`: keeps the lock until `min_hold` after it was taken, unless interrupted or
/// the lock is lost meanwhile.
pub(crate) fn hold_at_least(
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
            Ok(Event::Waited) => {}
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
