//! The loss watcher of one `Locker`: one thread for all its watched guards, instead of one
//! per guard. It asks each watched hold `Hold::held` every `Hold::probe_every` (the
//! strategies that nothing else tells of a loss), looks at each lease's local deadline when
//! it comes, and runs the callbacks of every lost lock.
//!
//! The watcher thread owns its set and only dispatches: the guards send it their watches
//! and releases, a `Loss` sends itself when it is lost (`loss.rs`'s `Tell`, under the
//! status's mutex: a send on a channel never blocks). Probes and callbacks run on helper
//! threads (`Runners`), started only while none is idle, so a probe hanging on a cut
//! connection, or a callback that blocks, holds up only itself; a callback that panics is
//! caught and logged. At most `MAX_PROBES` probes are under way at once; a probe due while
//! they are is put off by one period.
//!
//! The thread starts with the first watch and ends once the `Locker` and all its guards are
//! gone (the `Shared` part, which owns the `Watcher`, is dropped), after telling the losses
//! already queued. A released guard leaves the set at once.

use crate::hold::HoldCell;
use crate::loss::{LockStatus, Loss, Tell};
use crate::sync::Unpoison;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// At most this many probes under way at once (each may hang on its connection).
const MAX_PROBES: usize = 16;
/// A helper thread idle this long ends.
const RUNNER_IDLE: Duration = Duration::from_secs(5);

/// What the watcher thread hears.
enum Msg {
    Watch(Arc<Loss>, Arc<HoldCell>, String),
    /// The guard released its lock (or is dropped): out of the set.
    Unwatch(usize),
    /// This lock is lost: run its callbacks.
    Lost(Arc<Loss>),
    /// A probe of this entry ended.
    Probed(usize),
    /// The `Locker` and its guards are gone.
    Close,
}

/// An entry's id: the address of its `Loss`, which the entry keeps alive.
fn id(loss: &Arc<Loss>) -> usize {
    Arc::as_ptr(loss) as usize
}

/// The watcher of one `Locker`, kept in its `Shared` part. The thread starts with the first
/// watch.
pub(crate) struct Watcher {
    tx: Mutex<Sender<Msg>>,
    start: Mutex<Start>,
    /// The size of the set, as the thread last saw it.
    watched: Arc<AtomicUsize>,
}

enum Start {
    NotYet(Receiver<Msg>),
    Running(JoinHandle<()>),
    Failed,
}

impl std::fmt::Debug for Watcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watcher").finish_non_exhaustive()
    }
}

impl Default for Watcher {
    fn default() -> Self {
        let (tx, rx) = channel();
        Watcher {
            tx: Mutex::new(tx),
            start: Mutex::new(Start::NotYet(rx)),
            watched: Arc::default(),
        }
    }
}

impl Watcher {
    fn send(&self, msg: Msg) {
        // Fails only if the thread could not start or is gone: nothing to tell then.
        let _ = self.tx.lock().unpoisoned().send(msg);
    }

    /// Watches the guard's lock (once; later calls do nothing): its hold is probed if its
    /// strategy needs it, its lease deadline looked at, its callbacks run once it is lost.
    pub(crate) fn watch(&self, loss: &Arc<Loss>, cell: &Arc<HoldCell>, key: &str) {
        let tx = self.tx.lock().unpoisoned().clone();
        let tell = move || -> Tell {
            Box::new(move |loss| {
                let _ = tx.send(Msg::Lost(loss));
            })
        };
        // A loss told before the watch arrives (the lock was lost already) runs the
        // callbacks all the same: they are the `Loss`'s; the entry then leaves at its first
        // look, or with the guard.
        if loss.start_watching(tell) {
            self.ensure_thread();
            self.send(Msg::Watch(loss.clone(), cell.clone(), key.to_owned()));
        }
    }

    /// How many guards are in the set (as of the last message the thread handled).
    pub(crate) fn watched(&self) -> usize {
        self.watched.load(Ordering::Relaxed)
    }

    /// The guard released its lock: out of the set.
    pub(crate) fn unwatch(&self, loss: &Arc<Loss>) {
        if loss.watched() {
            self.send(Msg::Unwatch(id(loss)));
        }
    }

    fn ensure_thread(&self) {
        let mut start = self.start.lock().unpoisoned();
        if !matches!(*start, Start::NotYet(_)) {
            return;
        }
        let Start::NotYet(rx) = std::mem::replace(&mut *start, Start::Failed) else {
            unreachable!()
        };
        let tx = self.tx.lock().unpoisoned().clone();
        let watched = self.watched.clone();
        let spawned = std::thread::Builder::new()
            .name("dlock-watch".into())
            .spawn(move || Watching::new(tx, watched).run(&rx));
        *start = match spawned {
            Ok(handle) => Start::Running(handle),
            Err(e) => {
                log::warn!("could not start the loss watcher ({e}); only check() will tell a loss");
                Start::Failed
            }
        };
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.send(Msg::Close);
        let start = std::mem::replace(self.start.get_mut().unpoisoned(), Start::Failed);
        if let Start::Running(handle) = start {
            // The watcher thread only dispatches: it ends at once. (It never drops a
            // `Shared` itself, but a guard's last owner could be a callback on a runner.)
            if handle.thread().id() != std::thread::current().id() && handle.join().is_err() {
                log::warn!("the loss watcher thread panicked");
            }
        }
    }
}

struct Entry {
    loss: Arc<Loss>,
    cell: Arc<HoldCell>,
    key: Arc<str>,
    /// How often to probe the hold, if it needs probing.
    every: Option<Duration>,
    /// When it is to be looked at next (the heap holds stale times too).
    at: Option<Instant>,
    probing: bool,
}

/// The watcher thread's own state.
struct Watching {
    entries: HashMap<usize, Entry>,
    heap: BinaryHeap<Reverse<(Instant, usize)>>,
    probes: usize,
    /// Entries due for a probe while `MAX_PROBES` were under way, in the order they fell
    /// due: each is probed as a probe ends, before anything due later (so no entry is put
    /// off again and again behind others that fell due at the same instant).
    put_off: VecDeque<usize>,
    runners: Arc<Runners>,
    tx: Sender<Msg>,
    watched: Arc<AtomicUsize>,
}

impl Watching {
    fn new(tx: Sender<Msg>, watched: Arc<AtomicUsize>) -> Self {
        Watching {
            entries: HashMap::new(),
            heap: BinaryHeap::new(),
            probes: 0,
            put_off: VecDeque::new(),
            runners: Arc::default(),
            tx,
            watched,
        }
    }

    fn run(mut self, rx: &Receiver<Msg>) {
        loop {
            let now = Instant::now();
            self.look(now);
            self.watched.store(self.entries.len(), Ordering::Relaxed);
            // Jobs waiting: look again for stuck runners every `STALL`.
            let backlog = self.runners.backlog().then(|| now + STALL);
            self.runners.nudge();
            let next = match (self.heap.peek().map(|r| r.0 .0), backlog) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            let msg = match next {
                Some(at) => match rx.recv_timeout(at.saturating_duration_since(Instant::now())) {
                    Ok(m) => m,
                    Err(RecvTimeoutError::Timeout) => continue,
                    Err(RecvTimeoutError::Disconnected) => break,
                },
                None => match rx.recv() {
                    Ok(m) => m,
                    Err(_) => break,
                },
            };
            match msg {
                Msg::Watch(loss, cell, key) => self.add(loss, cell, key),
                Msg::Unwatch(id) => {
                    self.entries.remove(&id);
                }
                Msg::Lost(loss) => self.tell(&loss),
                Msg::Probed(id) => {
                    self.probes -= 1;
                    if let Some(e) = self.entries.get_mut(&id) {
                        e.probing = false;
                    }
                    self.probe_put_off(Instant::now());
                }
                Msg::Close => break,
            }
        }
        // Losses told before the close still run their callbacks.
        while let Ok(msg) = rx.try_recv() {
            if let Msg::Lost(loss) = msg {
                self.tell(&loss);
            }
        }
        self.runners.close();
        self.watched.store(0, Ordering::Relaxed);
    }

    fn add(&mut self, loss: Arc<Loss>, cell: Arc<HoldCell>, key: String) {
        let every = cell
            .read()
            .unpoisoned()
            .as_ref()
            .and_then(|h| h.probe_every());
        let id = id(&loss);
        let mut entry = Entry {
            loss,
            cell,
            key: key.into(),
            every,
            at: None,
            probing: false,
        };
        self.schedule(id, &mut entry, Instant::now());
        self.entries.insert(id, entry);
    }

    /// Sets when `entry` is looked at next: its next probe, or its lease deadline.
    fn schedule(&mut self, id: usize, entry: &mut Entry, now: Instant) {
        let at = match entry.every {
            Some(every) => Some(now + every),
            None => entry.loss.until(),
        };
        entry.at = at;
        if let Some(at) = at {
            self.heap.push(Reverse((at, id)));
        }
    }

    /// Looks at every entry due by `now`.
    fn look(&mut self, now: Instant) {
        while let Some(&Reverse((at, id))) = self.heap.peek() {
            if at > now {
                break;
            }
            self.heap.pop();
            let Some(mut entry) = self.entries.remove(&id) else {
                continue; // unwatched
            };
            if entry.at != Some(at) {
                self.entries.insert(id, entry); // rescheduled since
                continue;
            }
            // `status` applies a lease's deadline: a loss found here is told by the `Loss`.
            if entry.loss.status() != LockStatus::Held {
                continue; // lost (told) or released: out of the set
            }
            if entry.every.is_some() && !entry.probing {
                if self.probes < MAX_PROBES {
                    self.probe(id, &mut entry);
                } else {
                    log::debug!(
                        "lock {:?}: {MAX_PROBES} probes under way; this one waits its turn",
                        entry.key
                    );
                    // Not in the heap until probed: scheduled from its probe.
                    entry.at = None;
                    self.put_off.push_back(id);
                    self.entries.insert(id, entry);
                    continue;
                }
            }
            self.schedule(id, &mut entry, now);
            self.entries.insert(id, entry);
        }
    }

    /// Probes the entries put off, in turn, while fewer than `MAX_PROBES` are under way.
    fn probe_put_off(&mut self, now: Instant) {
        while self.probes < MAX_PROBES {
            let Some(id) = self.put_off.pop_front() else {
                return;
            };
            let Some(mut entry) = self.entries.remove(&id) else {
                continue; // unwatched meanwhile
            };
            if entry.at.is_some() || entry.probing {
                self.entries.insert(id, entry); // rescheduled meanwhile (watched anew)
                continue;
            }
            if entry.loss.status() != LockStatus::Held {
                continue; // lost (told) or released: out of the set
            }
            self.probe(id, &mut entry);
            self.schedule(id, &mut entry, now);
            self.entries.insert(id, entry);
        }
    }

    fn probe(&mut self, id: usize, entry: &mut Entry) {
        entry.probing = true;
        self.probes += 1;
        let (loss, cell, key, tx, every) = (
            entry.loss.clone(),
            entry.cell.clone(),
            entry.key.clone(),
            self.tx.clone(),
            entry.every,
        );
        self.runners.run(Box::new(move || {
            // A probe of this guard's session begun during the last half interval (for
            // another guard on the same shared session) answers for this one too.
            let since = every
                .and_then(|e| Instant::now().checked_sub(e / 2))
                .unwrap_or_else(Instant::now);
            let held = {
                let hold = cell.read().unpoisoned();
                hold.as_ref().map(|h| h.probe(&key, since))
            };
            match held {
                Some(Ok(false)) => loss.mark_lost(),
                // Not an answer: a row or session lock does not lapse while the database is
                // out of reach (a session strategy's failing connection counts as lost).
                Some(Err(e)) => log::debug!("lock {key:?}: the loss watcher could not ask ({e})"),
                Some(Ok(true)) | None => {}
            }
            let _ = tx.send(Msg::Probed(id));
        }));
    }

    /// Runs the callbacks of a lost lock, on a runner.
    fn tell(&mut self, loss: &Arc<Loss>) {
        self.entries.remove(&id(loss));
        let callbacks = loss.take_callbacks();
        if callbacks.is_empty() {
            return;
        }
        log::debug!("a lock was lost; telling those who asked");
        for f in callbacks {
            self.runners.run(Box::new(move || {
                if catch_unwind(AssertUnwindSafe(f)).is_err() {
                    log::error!("a loss callback panicked; the others still run");
                }
            }));
        }
    }
}

type Job = Box<dyn FnOnce() + Send>;

/// Runners started without waiting for a stall.
const RUNNERS: usize = 4;
/// With jobs waiting and no runner done with one for this long, all are stuck (a hanging
/// probe, a blocking callback): one more runner is started.
const STALL: Duration = Duration::from_millis(100);

/// The helper threads of a watcher: probes and callbacks, each on a thread that was idle.
/// Up to `RUNNERS` start as jobs come; beyond that one more only when the others have made
/// no progress for `STALL`, so a blocking callback costs one thread and delays the others
/// by `STALL` once.
#[derive(Default)]
struct Runners {
    state: Mutex<RunState>,
    wake: Condvar,
}

#[derive(Default)]
struct RunState {
    jobs: VecDeque<Job>,
    /// Runners alive, and of them idle.
    alive: usize,
    idle: usize,
    /// When a runner last started or finished a job (or was started).
    progress: Option<Instant>,
    closed: bool,
}

impl Runners {
    fn run(self: &Arc<Self>, job: Job) {
        self.state.lock().unpoisoned().jobs.push_back(job);
        self.wake.notify_one();
        self.nudge();
    }

    /// Whether jobs wait (the watcher then calls `nudge` every `STALL`).
    fn backlog(&self) -> bool {
        !self.state.lock().unpoisoned().jobs.is_empty()
    }

    /// Starts one more runner if jobs wait for one and none is idle, either because few are
    /// running or because those running made no progress for `STALL`.
    fn nudge(self: &Arc<Self>) {
        let spawn = {
            let mut st = self.state.lock().unpoisoned();
            let stalled = st.progress.is_none_or(|p| p.elapsed() >= STALL);
            let spawn = !st.jobs.is_empty()
                && st.idle == 0
                && !st.closed
                && (st.alive < RUNNERS || stalled);
            if spawn {
                st.alive += 1;
                st.progress = Some(Instant::now());
            }
            spawn
        };
        if spawn {
            let me = self.clone();
            let spawned = std::thread::Builder::new()
                .name("dlock-watch-run".into())
                .spawn(move || me.work());
            if let Err(e) = spawned {
                self.state.lock().unpoisoned().alive -= 1;
                // The job waits for a runner that is busy now.
                log::warn!("could not start a loss watcher runner: {e}");
            }
        }
    }

    fn close(&self) {
        self.state.lock().unpoisoned().closed = true;
        self.wake.notify_all();
    }

    fn work(&self) {
        let mut st = self.state.lock().unpoisoned();
        loop {
            if let Some(job) = st.jobs.pop_front() {
                st.progress = Some(Instant::now());
                drop(st);
                job();
                st = self.state.lock().unpoisoned();
                st.progress = Some(Instant::now());
                continue;
            }
            if st.closed {
                break;
            }
            st.idle += 1;
            let (g, timeout) = self.wake.wait_timeout(st, RUNNER_IDLE).unpoisoned();
            st = g;
            st.idle -= 1;
            if timeout.timed_out() && st.jobs.is_empty() {
                break;
            }
        }
        st.alive -= 1;
    }
}
