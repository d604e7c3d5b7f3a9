//! SQLite on Linux: the wake-up of a waiter granted the key, beside the database file. SQLite
//! has no notifications, and its waiters are processes of one machine: each `Locker` whose
//! waiters line up binds a Unix datagram socket of its own in the abstract namespace
//! (`dlock-` and 16 random hex digits, no file), names it in its places in a key's line
//! (`dlock_waiters.channel`), and a release that grants a place the key sends one datagram
//! (the key) to that name once its transaction has committed. A thread of the `Locker`,
//! started by its first wait, sleeps in `recv` and wakes the key's local waiters, which then
//! look at their place. Nothing here can stall anyone: a datagram that cannot be sent (the
//! waiter gone, its buffer full, another network namespace) is dropped, and the waiter
//! finds its grant at its next fallback look (`max_backoff`).

use crate::sync::Unpoison;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// What the thread calls with a key it was told of.
type Wake = Arc<dyn Fn(&str) + Send + Sync>;

/// A `Locker`'s doorbell: its socket, and its thread once started.
pub(crate) struct Doorbell {
    name: String,
    socket: Arc<UnixDatagram>,
    wake: Wake,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// Set by `drop` before it sends STOP: an empty datagram from anyone else (any local
    /// process can send to an abstract name) does not stop the thread.
    stopping: Arc<AtomicBool>,
}

impl std::fmt::Debug for Doorbell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Doorbell")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// The datagram that stops the thread (a key is never empty).
const STOP: &[u8] = b"";

impl Doorbell {
    /// Binds the socket; `wake(key)` is called for each grant rung.
    pub(crate) fn new(wake: impl Fn(&str) + Send + Sync + 'static) -> std::io::Result<Doorbell> {
        let name = format!("dlock-{:016x}", crate::random::random_u64());
        let socket = UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes())?)?;
        Ok(Doorbell {
            name,
            socket: Arc::new(socket),
            wake: Arc::new(wake),
            thread: Mutex::new(None),
            stopping: Arc::new(AtomicBool::new(false)),
        })
    }

    /// The name the `Locker`'s places carry.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Starts the thread if it is not running.
    pub(crate) fn start(&self) -> std::io::Result<()> {
        let mut thread = self.thread.lock().unpoisoned();
        if thread.is_some() {
            return Ok(());
        }
        let (socket, wake, stopping) = (
            self.socket.clone(),
            self.wake.clone(),
            self.stopping.clone(),
        );
        *thread = Some(
            std::thread::Builder::new()
                .name("dlock-doorbell".into())
                .spawn(move || {
                    let mut buf = [0u8; 512];
                    loop {
                        match socket.recv(&mut buf) {
                            Ok(0) if stopping.load(Ordering::Acquire) => return, // STOP
                            Ok(0) => log::debug!("doorbell: a STOP not from its Locker, ignored"),
                            Ok(n) => match std::str::from_utf8(&buf[..n]) {
                                Ok(key) => wake(key),
                                Err(_) => log::debug!("doorbell: a datagram that is no key"),
                            },
                            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                            Err(e) => {
                                log::warn!("doorbell: receiving failed ({e}); waiters poll");
                                return;
                            }
                        }
                    }
                })?,
        );
        Ok(())
    }
}

impl Drop for Doorbell {
    fn drop(&mut self) {
        if let Some(thread) = self.thread.lock().unpoisoned().take() {
            self.stopping.store(true, Ordering::Release);
            match ring_name(&self.name, STOP) {
                Ok(()) => {
                    let _ = thread.join();
                }
                Err(e) => log::debug!("doorbell: could not stop its thread ({e}); left to end"),
            }
        }
    }
}

fn ring_name(name: &str, payload: &[u8]) -> std::io::Result<()> {
    let to = SocketAddr::from_abstract_name(name.as_bytes())?;
    let s = UnixDatagram::unbound()?;
    s.set_nonblocking(true)?;
    s.send_to_addr(payload, &to).map(drop)
}

/// Tells the waiter whose place names `channel` that it was granted `key` (best effort).
pub(crate) fn ring(channel: Option<&str>, key: &str) {
    let Some(name) = channel.filter(|c| c.starts_with("dlock-")) else {
        return;
    };
    if let Err(e) = ring_name(name, key.as_bytes()) {
        log::trace!("doorbell {name}: not rung ({e}); the waiter finds its grant at its next look");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    /// An empty datagram from another sender (any local process may send one to the
    /// abstract name) does not stop the thread: a key rung afterwards still wakes; dropping
    /// the doorbell stops and joins it.
    #[test]
    fn only_its_own_drop_stops_the_thread() {
        let (tx, rx) = mpsc::channel::<String>();
        let tx = Mutex::new(tx);
        let bell = Doorbell::new(move |k| {
            let _ = tx.lock().unpoisoned().send(k.to_owned());
        })
        .unwrap();
        bell.start().unwrap();
        ring_name(bell.name(), STOP).unwrap();
        ring_name(bell.name(), b"some-key").unwrap();
        assert_eq!(
            rx.recv_timeout(Duration::from_secs(10)).unwrap(),
            "some-key",
            "the thread stopped on a stranger's STOP"
        );
        drop(bell); // joins the thread: a hang here fails by the test's timeout
        assert!(rx.recv_timeout(Duration::from_millis(50)).is_err());
    }
}
