//! PostgreSQL: a connection of a `Locker`'s own that `LISTEN`s for releases, so that waiters
//! are woken when a holder in another process releases instead of at their next poll.
//!
//! Each listener hears a channel of its own (`dlock_w_` and 16 random hex digits), which
//! its `Locker`'s waiters name in their places in a key's line (`dlock_waiters`); releases of
//! `Row` and `Lease` locks notify the first live place's channel, with the key as payload, in
//! the releasing statement itself (no extra round trip). So a release wakes one process, the
//! one whose turn it is. diesel's `PgConnection` can
//! only *poll* for notifications (`notifications_iter` consumes what the socket has
//! buffered and never blocks), so the thread polls: every [`BUSY_POLL`] while the `Locker`
//! has waiters, every [`IDLE_POLL`] otherwise (notifications must still be read, or the
//! server's queue backs up behind this session). A lost connection is re-established; as
//! notifications may have been missed meanwhile, every waiter is then woken to look.

use diesel::pg::PgConnection;
use diesel::{Connection, RunQueryDsl};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// How often the socket is read while this `Locker` has waiters.
pub(crate) const BUSY_POLL: Duration = Duration::from_micros(200);
/// How often while it has none.
pub(crate) const IDLE_POLL: Duration = Duration::from_millis(100);

#[derive(Default)]
struct Control {
    stop: bool,
    /// Set by `poke`: a waiter has just begun to wait.
    poked: bool,
    /// The thread is (re)connecting, which can take as long as the server, or the network,
    /// takes to answer: `Drop` does not wait for it then.
    connecting: bool,
}

/// The listening thread; dropping this stops it and waits for it to end, unless it is in the
/// middle of connecting: then it is left to end by itself once the attempt returns.
pub(crate) struct Listener {
    control: Arc<(Mutex<Control>, Condvar)>,
    thread: Option<JoinHandle<()>>,
    /// The channel this listener hears: its own, named in its `Locker`'s places in line.
    channel: String,
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener").finish_non_exhaustive()
    }
}

impl Listener {
    /// Starts listening on a connection to `url`. `wake(Some(key))` is called for every
    /// release notified, `wake(None)` when some may have been missed; `busy()` says whether
    /// the `Locker` has waiters.
    pub(crate) fn start(
        url: String,
        wake: impl Fn(Option<&str>) + Send + 'static,
        busy: impl Fn() -> bool + Send + 'static,
    ) -> std::io::Result<Listener> {
        let control = Arc::new((Mutex::new(Control::default()), Condvar::new()));
        let c = control.clone();
        // Lowercase letters, digits and '_' only: a plain identifier for LISTEN, which takes
        // no bound parameter (the releases' pg_notify does take it bound).
        let channel = format!("dlock_w_{:016x}", crate::random::random_u64());
        let ch = channel.clone();
        let thread = std::thread::Builder::new()
            .name("dlock-listen".into())
            .spawn(move || run(&url, &ch, &c, &wake, &busy))?;
        Ok(Listener {
            control,
            thread: Some(thread),
            channel,
        })
    }

    /// The channel this listener hears.
    pub(crate) fn channel(&self) -> &str {
        &self.channel
    }

    /// Makes an idle listener start polling at the busy rate at once.
    pub(crate) fn poke(&self) {
        let (m, cv) = &*self.control;
        let mut c = m.lock().unwrap_or_else(|p| p.into_inner());
        if !c.poked {
            c.poked = true;
            cv.notify_one();
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        let (m, cv) = &*self.control;
        let connecting = {
            let mut c = m.lock().unwrap_or_else(|p| p.into_inner());
            c.stop = true;
            c.connecting
        };
        cv.notify_one();
        let Some(t) = self.thread.take() else { return };
        if connecting {
            log::debug!("release listener: still connecting; not waiting for it to end");
        } else if t.join().is_err() {
            log::warn!("the release listener thread panicked");
        }
    }
}

fn connect(url: &str, channel: &str) -> diesel::QueryResult<PgConnection> {
    let mut conn = PgConnection::establish(url)
        .map_err(|e| diesel::result::Error::QueryBuilderError(e.into()))?;
    debug_assert!(channel
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'));
    diesel::sql_query(format!("LISTEN {channel}")).execute(&mut conn)?;
    Ok(conn)
}

/// Connects, with `connecting` set meanwhile; `None` if the listener was stopped first.
fn connect_unless_stopped(
    url: &str,
    channel: &str,
    control: &(Mutex<Control>, Condvar),
) -> Option<diesel::QueryResult<PgConnection>> {
    let (m, _) = control;
    {
        let mut c = m.lock().unwrap_or_else(|p| p.into_inner());
        if c.stop {
            return None;
        }
        c.connecting = true;
    }
    let attempt = connect(url, channel);
    m.lock().unwrap_or_else(|p| p.into_inner()).connecting = false;
    Some(attempt)
}

fn run(
    url: &str,
    channel: &str,
    control: &(Mutex<Control>, Condvar),
    wake: &dyn Fn(Option<&str>),
    busy: &dyn Fn() -> bool,
) {
    let mut conn: Option<PgConnection> = None;
    let mut retry = Duration::from_millis(100);
    loop {
        let mut pause = if busy() { BUSY_POLL } else { IDLE_POLL };
        match &mut conn {
            None => {
                let Some(attempt) = connect_unless_stopped(url, channel, control) else {
                    return;
                };
                match attempt {
                    Ok(c) => {
                        conn = Some(c);
                        if retry > Duration::from_millis(100) {
                            log::warn!("release listener: listening again");
                        }
                        retry = Duration::from_millis(100);
                        // Releases before LISTEN took effect were not heard: let everyone look.
                        wake(None);
                    }
                    Err(e) => {
                        // One warning per outage, not one per retry.
                        if retry == Duration::from_millis(100) {
                            log::warn!("release listener: cannot listen ({e}); retrying");
                        } else {
                            log::debug!(
                                "release listener: cannot listen ({e}); retrying in {retry:?}"
                            );
                        }
                        pause = retry;
                        retry = (retry * 2).min(Duration::from_secs(5));
                    }
                }
            }
            Some(c) => {
                let mut lost = false;
                for n in c.notifications_iter() {
                    match n {
                        Ok(n) if n.channel == channel => wake(Some(&n.payload)),
                        Ok(_) => {}
                        Err(e) => {
                            log::debug!("release listener: connection lost ({e}); reconnecting");
                            lost = true;
                            break;
                        }
                    }
                }
                if lost {
                    conn = None;
                    wake(None);
                }
            }
        }
        let (m, cv) = control;
        let mut c = m.lock().unwrap_or_else(|p| p.into_inner());
        if !c.stop && !c.poked {
            c = cv
                .wait_timeout(c, pause)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        if c.stop {
            return;
        }
        c.poked = false;
    }
}
