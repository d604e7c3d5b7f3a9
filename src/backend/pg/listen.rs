//! PostgreSQL: a connection of a `Locker`'s own that `LISTEN`s for releases, so that waiters
//! are woken when a holder in another process releases instead of at their next poll.
//!
//! Each listener hears a channel of its own (`dlock_v_` and 16 random hex digits), which
//! its `Locker`'s waiters name in their places in a key's line (`dlock_waiters`); releases of
//! `Row` and `Lease` locks notify the first live place's channel in the releasing statement
//! itself (no extra round trip). So a release wakes one process, the one whose turn it is. A
//! release that grants the key tells what it gave on the channel's grants channel (its name
//! and `GRANTS`: `grant_in` reads the place, its holder id, the token and the time, then the
//! key), and the waiter takes it with no look of its own. Only the grant statements write
//! there, from the place's own row: a key, however it reads, cannot pass for a grant. Any
//! other payload, on the channel itself, is the key. A place whose channel is not a
//! listener's of this kind (`TOLD`: an older build's) is notified with the key, as before. Releases of a `Lease` `Locker`'s readers, writers and permits,
//! which have no line, still notify a channel every listener hears (`SHARED_CHANNEL`).
//!
//! The connection is a libpq connection of its own (`socket.rs`), not a diesel one:
//! diesel can only poll for notifications, while this thread sleeps in `poll(2)` until the
//! socket, or its wake-up socket (the `Listener` being dropped), has something to read. A
//! lost connection is re-established; as notifications may have been missed meanwhile,
//! every waiter is then woken to look.

use super::socket::RawListener;
use crate::backend::Told;
use crate::sync::Unpoison;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// The channel every listener also hears: the releases of a `Lease` `Locker`'s readers,
/// writers and permits (`holders_release`), whose waiters have no line, notify it with the
/// key as payload.
pub(crate) const SHARED_CHANNEL: &str = "dlock_release";

/// How the channels of listeners that hear grants on their grants channel begin (`GRANTS`);
/// an older build's began `dlock_w_`. The grant statements test for it (`locks.rs`'s
/// `grant_notify!`).
pub(crate) const TOLD: &str = "dlock_v_";

/// What a listener's channel name is followed by in the name of its grants channel.
pub(crate) const GRANTS: &str = "_g";

/// What the listening thread heard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Heard<'a> {
    /// A release of the key (a payload of the listener's own channel or of `SHARED_CHANNEL`).
    Key(&'a str),
    /// A grant of the key to a place, as its grants channel told it.
    Grant(&'a str, Told),
    /// Some notifications may have been missed (the connection was re-established).
    Missed,
}

/// A grant told on a grants channel (`locks.rs`'s `grant_note!`): the place's id, the holder
/// id, the token and the acquisition time in microseconds since the epoch, then the key.
/// `None` for a payload not of that form (none is sent there).
pub(crate) fn grant_in(payload: &str) -> Option<(&str, Told)> {
    let mut parts = payload.splitn(5, ' ');
    let place = parts.next()?.parse().ok()?;
    let holder = parts.next()?;
    let token = parts.next()?.parse().ok()?;
    let acquired_us = parts.next()?.parse().ok()?;
    let key = parts.next()?;
    Some((
        key,
        Told {
            place,
            holder: holder.to_owned(),
            token,
            acquired_us,
        },
    ))
}

/// What the thread calls with what it heard.
type Wake = Box<dyn Fn(Heard<'_>) + Send>;

#[derive(Default)]
struct Control {
    stop: bool,
    /// The thread is (re)connecting, which can take as long as the server, or the network,
    /// takes to answer: `Drop` does not wait for it then.
    connecting: bool,
}

/// The listening thread, started by the first wait (`start`): a `Locker` that never waits
/// opens no listening connection. Dropping this stops the thread and waits for it to end; a
/// thread in the middle of connecting is waited for up to `CONNECTING_PATIENCE`, and left
/// to end by itself after that (a server that never answers cannot hang the drop).
pub(crate) struct Listener {
    url: String,
    wake_fn: Mutex<Option<Wake>>,
    control: Arc<(Mutex<Control>, Condvar)>,
    /// Written to wake the thread from its wait (to stop); the thread reads the other end.
    wake: UnixStream,
    woken: Mutex<Option<UnixStream>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// The channel this listener hears: its own, named in its `Locker`'s places in line.
    channel: String,
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener")
            .field("channel", &self.channel)
            .finish_non_exhaustive()
    }
}

impl Listener {
    /// A listener for `url`, not started yet. `wake` is called with every release or grant
    /// notified, and with `Heard::Missed` when some may have been missed.
    pub(crate) fn new(
        url: String,
        wake: impl Fn(Heard<'_>) + Send + 'static,
    ) -> std::io::Result<Listener> {
        let (waker, woken) = UnixStream::pair()?;
        woken.set_nonblocking(true)?;
        // Lowercase letters, digits and '_' only: a plain identifier for LISTEN, which takes
        // no bound parameter (the releases' pg_notify does take it bound).
        let channel = format!("{TOLD}{:016x}", crate::random::random_u64());
        Ok(Listener {
            url,
            wake_fn: Mutex::new(Some(Box::new(wake))),
            control: Arc::new((Mutex::new(Control::default()), Condvar::new())),
            wake: waker,
            woken: Mutex::new(Some(woken)),
            thread: Mutex::new(None),
            channel,
        })
    }

    /// Starts the thread, once. Until its `LISTEN` has taken effect nothing is heard, and
    /// waiters look every `max_backoff`; it wakes every waiter once it listens.
    pub(crate) fn start(&self) -> std::io::Result<()> {
        let mut thread = self.thread.lock().unpoisoned();
        if thread.is_some() {
            return Ok(());
        }
        let (Some(wake), Some(woken)) = (
            self.wake_fn.lock().unpoisoned().take(),
            self.woken.lock().unpoisoned().take(),
        ) else {
            return Ok(()); // a start that failed before: waiters poll
        };
        let (url, ch, c) = (self.url.clone(), self.channel.clone(), self.control.clone());
        *thread = Some(
            std::thread::Builder::new()
                .name("dlock-listen".into())
                .spawn(move || run(&url, &ch, &c, woken, &wake))?,
        );
        Ok(())
    }

    /// The channel this listener hears.
    pub(crate) fn channel(&self) -> &str {
        &self.channel
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        let connecting = {
            let (m, changed) = &*self.control;
            let mut c = lock(m);
            c.stop = true;
            // A process that exits while libpq connects on this thread can crash in libpq's
            // GSSAPI or OpenSSL exit-time cleanup: a connection attempt under way usually
            // ends within milliseconds, so the drop waits for it a little.
            let (c, _) = changed
                .wait_timeout_while(c, CONNECTING_PATIENCE, |c| c.connecting)
                .unpoisoned();
            c.connecting
        };
        // Ends the thread's wait (a full socket buffer means it has a wake-up pending anyway).
        let _ = (&self.wake).write(&[1]);
        let thread = self.thread.get_mut().unpoisoned();
        let Some(t) = thread.take() else { return };
        if connecting {
            log::debug!("release listener: still connecting; not waiting for it to end");
        } else if t.join().is_err() {
            log::warn!("the release listener thread panicked");
        }
    }
}

/// How long dropping a `Listener` waits for a connection attempt under way to end.
const CONNECTING_PATIENCE: Duration = Duration::from_secs(2);

fn lock(control: &Mutex<Control>) -> std::sync::MutexGuard<'_, Control> {
    control.lock().unpoisoned()
}

fn connect(url: &str, channel: &str) -> Result<RawListener, String> {
    let mut conn = RawListener::connect(&with_connect_timeout(url))?;
    debug_assert!(channel
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'));
    conn.execute(&format!(
        "LISTEN {channel}; LISTEN {channel}{GRANTS}; LISTEN {SHARED_CHANNEL}"
    ))?;
    Ok(conn)
}

/// `url` with libpq's `connect_timeout` (10 s) unless it names one: without it a server that
/// accepts the connection and never answers would keep the thread (and its socket) in
/// `PQconnectdb` for good: a thread per dropped `Locker`.
fn with_connect_timeout(url: &str) -> String {
    if url.contains("connect_timeout") {
        url.to_owned()
    } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let sep = if url.contains('?') { '&' } else { '?' };
        format!("{url}{sep}connect_timeout=10")
    } else {
        format!("{url} connect_timeout=10") // key=value connection string
    }
}

/// Connects, with `connecting` set meanwhile; `None` if the listener was stopped first.
fn connect_unless_stopped(
    url: &str,
    channel: &str,
    control: &(Mutex<Control>, Condvar),
) -> Option<Result<RawListener, String>> {
    let (m, changed) = control;
    {
        let mut c = lock(m);
        if c.stop {
            return None;
        }
        c.connecting = true;
    }
    let attempt = connect(url, channel);
    lock(m).connecting = false;
    changed.notify_all();
    Some(attempt)
}

fn run(
    url: &str,
    channel: &str,
    control: &(Mutex<Control>, Condvar),
    mut woken: UnixStream,
    wake: &dyn Fn(Heard<'_>),
) {
    let grants = format!("{channel}{GRANTS}");
    let mut conn: Option<RawListener> = None;
    let mut retry = Duration::from_millis(100);
    loop {
        if lock(&control.0).stop {
            return;
        }
        // How long to wait: for a notification as long as it takes; before reconnecting,
        // the retry pause (cut short by a stop as well).
        let mut pause = None;
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
                        wake(Heard::Missed);
                        continue;
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
                        pause = Some(retry);
                        retry = (retry * 2).min(Duration::from_secs(5));
                    }
                }
            }
            Some(c) => match c.wait(None, woken.as_raw_fd()) {
                Ok(heard) => {
                    for n in heard {
                        if n.channel == grants {
                            match grant_in(&n.payload) {
                                Some((key, told)) => wake(Heard::Grant(key, told)),
                                None => log::debug!(
                                    "release listener: a grant not understood: {:?}",
                                    n.payload
                                ),
                            }
                        } else if n.channel == channel || n.channel == SHARED_CHANNEL {
                            wake(Heard::Key(&n.payload));
                        }
                    }
                }
                Err(e) => {
                    log::debug!("release listener: connection lost ({e}); reconnecting");
                    conn = None;
                    wake(Heard::Missed);
                }
            },
        }
        if let Some(pause) = pause {
            wait_woken(&woken, pause);
        }
        // Empties the wake-up socket (a stop is seen at the top of the loop).
        let mut buf = [0u8; 64];
        while matches!(woken.read(&mut buf), Ok(n) if n > 0) {}
    }
}

/// Sleeps up to `pause`, or until the wake-up socket has something to read.
fn wait_woken(woken: &UnixStream, pause: Duration) {
    let _ = woken.set_nonblocking(false);
    let _ = woken.set_read_timeout(Some(pause));
    let _ = (&*woken).read(&mut [0u8; 1]);
    let _ = woken.set_nonblocking(true);
}

#[cfg(test)]
mod tests {
    use super::grant_in;
    use crate::backend::Told;

    #[test]
    fn a_grant_is_read_with_a_key_that_has_spaces() {
        let told = grant_in("42 0123abcd 7 1764000000123456 nightly report 2");
        assert_eq!(
            told,
            Some((
                "nightly report 2",
                Told {
                    place: 42,
                    holder: "0123abcd".to_owned(),
                    token: 7,
                    acquired_us: 1_764_000_000_123_456,
                }
            ))
        );
    }

    #[test]
    fn a_plain_key_is_no_grant() {
        assert_eq!(grant_in("nightly-report"), None);
        assert_eq!(grant_in("1 2 3"), None);
        assert_eq!(grant_in("1 h x 4 key"), None);
        assert_eq!(grant_in(""), None);
    }
}
