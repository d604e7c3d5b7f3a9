//! While the command of `dlock run` runs: the events the signal thread and the lock watcher
//! send, the watcher that checks the lock (`watch`, at the pace `watch_plan` sets from what
//! the library says about the strategy), the loop that waits for the command, passes signals
//! on and stops it if the lock is lost (`supervise`), and `--min-hold` (`hold_at_least`).

use crate::args::{chain, deadline_after, round_ms, Failure};
use crate::job::{signal_name, Job};
use diesel_lock::{AnyConnection, Error, LockGuard, Strategy};
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

/// How `watch` keeps an eye on a lock of `strategy`: how often it checks the lock, and how
/// long it may go without a successful check before the lock must be presumed lost (`None`:
/// never; only a check that finds the lock gone ends it). The library answers both.
pub(crate) fn watch_plan(strategy: Strategy) -> (Duration, Option<Duration>) {
    (strategy.check_every(), strategy.expires_after())
}

/// Checks the lock every `every` until told to stop; reports a loss on `tx`.
pub(crate) fn watch(
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watch_plan_per_strategy() {
        let s = Duration::from_secs;
        assert_eq!(
            watch_plan(Strategy::Lease { ttl: s(30) }),
            (s(10), Some(s(30)))
        );
        let row = |stale_after| Strategy::Row { stale_after };
        assert_eq!(watch_plan(row(Some(s(6)))), (s(2), None));
        assert_eq!(watch_plan(row(Some(s(60)))), (s(5), None));
        assert_eq!(watch_plan(row(None)), (s(5), None));
        assert_eq!(watch_plan(Strategy::ForUpdate), (s(1), None));
        assert_eq!(watch_plan(Strategy::Advisory), (s(1), None));
    }
}
