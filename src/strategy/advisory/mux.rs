//! The shared sessions of an `Advisory` `Locker`: its exclusive locks are held on a few
//! pooled connections (at most [`Mux::cap`]), many locks per session, each released on its
//! own (`pg_advisory_unlock` / `RELEASE_LOCK` on the session that holds it). So the number
//! of connections a `Locker` uses no longer follows the number of locks it holds.
//!
//! - A *try* (an attempt that does not wait) runs on a shared session, under that session's
//!   statement mutex; statements there never wait for a lock, so nothing blocks behind
//!   another guard's statement for longer than one statement.
//! - A *wait* runs on a session of its own (`AdvisoryLock::try_acquire` with the attempt's
//!   connection), never on a shared one. Once it wins, its session joins the shared ones if
//!   there are fewer than `cap` (the lock stays where it is: a lock cannot move between
//!   sessions without a moment where the key is free, or waiting on a shared session);
//!   otherwise it keeps the lock on its own session, as before.
//! - The server's advisory locks are reentrant per session, the library's are not: each
//!   session knows the keys it holds (`Inner::keys`), and a try of a key it holds already is
//!   "busy" without asking the server.
//! - A session that ends (killed from the server, a network cut, a restart) ends every lock
//!   on it: its first failing statement marks it lost, and from then on every guard on it
//!   reports the loss (`held`, `release`). An error that may leave a lock on the session
//!   that no guard owns closes the session for the same reason: nothing may stay locked for
//!   nobody.
//! - Loss probing: a session is alive, or not; while alive it holds every key in its set
//!   (only our unlocks take them away). So one query per session (its server id, which
//!   must not change) answers for all its guards: [`MuxHold::probe`] reuses the answer of a
//!   query started after the caller's `since`.
//! - A session that holds nothing and is in no one's use goes back to the pool.

use super::super::session::discard;
use super::super::{Hold, Pool, Pooled, Taken};
use crate::backend::{Acquired, LockConnection, Sql, Wait};
use crate::sync::Unpoison;
use crate::{Error, Result};
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The most shared sessions of one `Locker` by default: enough for a few threads to take
/// locks side by side, few enough to leave a small pool room for waits.
pub(crate) const MAX_SHARED: usize = 4;

/// How many locks a shared session holds before a try prefers to open another one (while
/// fewer than `cap` are open): PostgreSQL's cost of every statement on a session grows with
/// the locks it holds (each transaction's end walks the session's lock table), so the locks
/// are spread over the sessions allowed.
const SPREAD_AT: usize = 256;

/// The shared sessions of one `Advisory` `Locker`.
pub(crate) struct Mux<C: LockConnection> {
    pool: Pool<C>,
    cap: usize,
    sessions: Mutex<Vec<Arc<MuxSession<C>>>>,
}

/// One shared session.
pub(crate) struct MuxSession<C: LockConnection> {
    /// The statement mutex, with what it guards.
    inner: Mutex<Inner<C>>,
    /// Threads that picked this session for a try and have not finished it (changed under
    /// the `Mux`'s registry mutex only).
    users: AtomicUsize,
    /// How many keys it holds (`Inner::keys.len()`, readable without the statement mutex).
    held: AtomicUsize,
    /// Set once the session failed: every lock on it is lost, for good.
    lost: AtomicBool,
}

struct Inner<C: LockConnection> {
    /// `None` once the session was closed (lost) or given back to the pool.
    conn: Option<Pooled<C>>,
    /// The keys this session holds, one guard each.
    keys: HashSet<String>,
    /// The server's id of the session (`pg_backend_pid()`, `CONNECTION_ID()`), learnt at
    /// its first probe: a later probe that finds another id found another session.
    server_id: Option<i64>,
    /// When the last successful probe of the session began.
    checked: Option<Instant>,
}

impl<C: LockConnection> Mux<C> {
    /// At most half the pool (at least one session, at most [`MAX_SHARED`]): the rest is
    /// left for waits, each on a session of its own, and for the user's other work.
    pub(crate) fn new(pool: Pool<C>) -> Self {
        let cap = (pool.max_size() as usize / 2).clamp(1, MAX_SHARED);
        Mux {
            pool,
            cap,
            sessions: Mutex::new(Vec::new()),
        }
    }

    /// How many shared sessions this `Locker` may use at most.
    #[allow(dead_code)]
    pub(crate) fn cap(&self) -> usize {
        self.cap
    }

    /// The shared sessions open now.
    pub(crate) fn open(&self) -> usize {
        self.sessions.lock().unpoisoned().len()
    }

    /// One try of `key` on a shared session: the lock with its token, or `None` if busy
    /// (held elsewhere, or by another guard of this `Locker`).
    ///
    /// `offer`: a connection the caller has (the first attempt of a `Locker` has one), used
    /// if a new session is wanted; one left unused goes back to the pool with `offer`.
    pub(crate) fn try_lock(
        self: &Arc<Self>,
        key: &str,
        offer: &mut Option<Pooled<C>>,
    ) -> Result<Option<Taken>> {
        // A session found lost between being picked and being used: pick again (the lost
        // one has left the registry), a few times at most.
        for _ in 0..3 {
            let session = self.pick(offer)?;
            let mut inner = session.inner.lock().unpoisoned();
            let attempt = session.try_lock(&mut inner, key);
            self.finish(&session, &mut inner, true);
            drop(inner);
            match attempt {
                Ok(Some(a)) => {
                    return Ok(Some(Taken {
                        hold: Box::new(MuxHold {
                            mux: self.clone(),
                            session,
                        }),
                        token: a.token,
                        acquired_at: a.acquired_at,
                    }))
                }
                Ok(None) => return Ok(None),
                Err(Some(e)) => return Err(e),
                Err(None) => continue,
            }
        }
        Err(Error::Database(diesel::result::Error::DatabaseError(
            diesel::result::DatabaseErrorKind::ClosedConnection,
            Box::new("the shared sessions of this Locker keep failing".to_owned()),
        )))
    }

    /// Makes `conn`, whose session just won `key` in a wait, a shared session if there are
    /// fewer than `cap`; otherwise gives it back (the lock stays on its own session).
    pub(crate) fn adopt(
        self: &Arc<Self>,
        conn: Pooled<C>,
        key: &str,
    ) -> std::result::Result<Box<dyn Hold>, Pooled<C>> {
        let mut sessions = self.sessions.lock().unpoisoned();
        sessions.retain(|s| !s.lost.load(Ordering::Acquire));
        if sessions.len() >= self.cap {
            return Err(conn);
        }
        let session = Arc::new(MuxSession {
            inner: Mutex::new(Inner {
                conn: Some(conn),
                keys: HashSet::from([key.to_owned()]),
                server_id: None,
                checked: None,
            }),
            users: AtomicUsize::new(0),
            held: AtomicUsize::new(1),
            lost: AtomicBool::new(false),
        });
        sessions.push(session.clone());
        Ok(Box::new(MuxHold {
            mux: self.clone(),
            session,
        }))
    }

    /// A shared session for one try, counted as in use until [`finish`](Self::finish): an
    /// idle one holding fewer than [`SPREAD_AT`] locks if any (the one holding fewest), else
    /// a new one while there are fewer than `cap` (and the pool has one idle), else the least
    /// busy.
    fn pick(&self, offer: &mut Option<Pooled<C>>) -> Result<Arc<MuxSession<C>>> {
        let best = |sessions: &mut Vec<Arc<MuxSession<C>>>| {
            sessions.retain(|s| !s.lost.load(Ordering::Acquire));
            sessions
                .iter()
                .min_by_key(|s| {
                    (
                        s.users.load(Ordering::Relaxed),
                        s.held.load(Ordering::Relaxed),
                    )
                })
                .cloned()
        };
        loop {
            let existing = {
                let mut sessions = self.sessions.lock().unpoisoned();
                match best(&mut sessions) {
                    Some(s)
                        if (s.users.load(Ordering::Relaxed) == 0
                            && s.held.load(Ordering::Relaxed) < SPREAD_AT)
                            || sessions.len() >= self.cap =>
                    {
                        s.users.fetch_add(1, Ordering::Relaxed);
                        return Ok(s);
                    }
                    other => other.is_some(),
                }
            };
            // Every session busy and room for one more, or none at all: a new one. Only
            // one the pool has idle if others exist (not worth waiting for).
            let conn = if let Some(c) = offer.take() {
                Some(c)
            } else if existing {
                // An idle one, or one the pool has room to open; never a wait for one that
                // others hold.
                self.pool.try_get().or_else(|| {
                    let state = self.pool.state();
                    (state.connections < self.pool.max_size())
                        .then(|| self.pool.get_timeout(patience(&self.pool)).ok())
                        .flatten()
                })
            } else {
                Some(
                    self.pool
                        .get_timeout(patience(&self.pool))
                        .map_err(Error::Pool)?,
                )
            };
            let mut sessions = self.sessions.lock().unpoisoned();
            let fallback = best(&mut sessions);
            match (conn, fallback) {
                (Some(conn), _) if sessions.len() < self.cap => {
                    let session = Arc::new(MuxSession {
                        inner: Mutex::new(Inner {
                            conn: Some(conn),
                            keys: HashSet::new(),
                            server_id: None,
                            checked: None,
                        }),
                        users: AtomicUsize::new(1),
                        held: AtomicUsize::new(0),
                        lost: AtomicBool::new(false),
                    });
                    sessions.push(session.clone());
                    return Ok(session);
                }
                // (A connection taken meanwhile goes back to the pool, unused.)
                (conn, Some(s)) => {
                    if offer.is_none() {
                        *offer = conn;
                    }
                    s.users.fetch_add(1, Ordering::Relaxed);
                    return Ok(s);
                }
                // The sessions there were have been lost meanwhile: again, waiting for one.
                (_, None) => continue,
            }
        }
    }

    /// After a statement on `session` (its statement mutex held as `inner`): one user less
    /// if `was_user`; a session that holds nothing and that nobody is about to use leaves
    /// the registry and goes back to the pool (closed if lost or if a panic is under way).
    fn finish(&self, session: &Arc<MuxSession<C>>, inner: &mut Inner<C>, was_user: bool) {
        let mut sessions = self.sessions.lock().unpoisoned();
        let users = if was_user {
            session.users.fetch_sub(1, Ordering::Relaxed) - 1
        } else {
            session.users.load(Ordering::Relaxed)
        };
        let lost = session.lost.load(Ordering::Acquire);
        if lost || (users == 0 && inner.keys.is_empty()) {
            sessions.retain(|s| !Arc::ptr_eq(s, session));
            if !inner.keys.is_empty() {
                return; // lost, with guards still to tell: closed already
            }
            if let Some(mut conn) = inner.conn.take() {
                if lost || std::thread::panicking() {
                    discard(&mut *conn);
                }
                drop(sessions);
                drop(conn);
            }
        }
    }
}

/// How long a try waits for a connection for a new shared session: a second (opening one
/// can take that long on a loaded machine), or the pool's timeout if shorter.
fn patience<C: LockConnection>(pool: &Pool<C>) -> Duration {
    pool.connection_timeout().min(Duration::from_secs(1))
}

impl<C: LockConnection> MuxSession<C> {
    /// One try of `key` on this session. `Err(None)`: the session is lost (pick another).
    fn try_lock(
        &self,
        inner: &mut Inner<C>,
        key: &str,
    ) -> std::result::Result<Option<Acquired>, Option<Error>> {
        if self.lost.load(Ordering::Acquire) {
            return Err(None);
        }
        // Ours already, on this session (whose server would grant it once more).
        if inner.keys.contains(key) {
            return Ok(None);
        }
        let Some(conn) = inner.conn.as_mut() else {
            return Err(None);
        };
        let attempt = conn
            .session_sql()
            .and_then(|s| s.advisory_lock(key, Wait::No));
        match attempt {
            Ok(Some(a)) => {
                inner.keys.insert(key.to_owned());
                self.held.store(inner.keys.len(), Ordering::Relaxed);
                Ok(Some(a))
            }
            Ok(None) => Ok(None),
            Err(e) => {
                let e = Error::from(e);
                if !crate::error::is_connection_lost(&e) && self.undo(conn, key) {
                    return Err(Some(e));
                }
                // Gone, or perhaps holding the key for nobody: closed, every lock on it lost.
                log::warn!("lock {key:?}: a shared session failed ({e}); it is closed, and every lock on it lost");
                self.lose(inner);
                if crate::error::is_connection_lost(&e) {
                    // The try itself took nothing: another session (or a new one) is asked.
                    return Err(None);
                }
                Err(Some(e))
            }
        }
    }

    /// After a failed try of `key` (which this session did not hold before): makes sure the
    /// session does not hold it now (the lock may be granted before the statement failed).
    /// False if that cannot be shown.
    fn undo(&self, conn: &mut Pooled<C>, key: &str) -> bool {
        let Ok(sql) = conn.session_sql() else {
            return false;
        };
        match sql.advisory_held(key) {
            Ok(false) => true,
            Ok(true) => matches!(sql.advisory_unlock(key), Ok(true)),
            Err(_) => false,
        }
    }

    /// Marks the session lost and closes it: the server frees every lock on it.
    fn lose(&self, inner: &mut Inner<C>) {
        self.lost.store(true, Ordering::Release);
        if let Some(mut conn) = inner.conn.take() {
            discard(&mut *conn);
        }
    }

    /// Whether `key` is still held by this session, by a probe that began after `since`
    /// (one already made is reused).
    fn probe(&self, key: &str, since: Instant) -> bool {
        let mut inner = self.inner.lock().unpoisoned();
        if self.lost.load(Ordering::Acquire) {
            return false;
        }
        if inner.checked.is_some_and(|c| c >= since) {
            return inner.keys.contains(key);
        }
        let start = Instant::now();
        let Some(conn) = inner.conn.as_mut() else {
            return false;
        };
        let id = conn.session_sql().and_then(|s| s.session_id());
        match (id, inner.server_id) {
            (Ok(id), Some(known)) if id != known => {
                log::warn!("a shared session of lock {key:?} changed its server id ({known} → {id}); every lock on it lost");
                self.lose(&mut inner);
            }
            (Ok(id), _) => {
                inner.server_id = Some(id);
                inner.checked = Some(start);
            }
            (Err(e), _) => {
                log::warn!("lock {key:?}: the shared session holding it failed ({e}); every lock on it is lost");
                self.lose(&mut inner);
            }
        }
        !self.lost.load(Ordering::Acquire) && inner.keys.contains(key)
    }
}

/// A lock held on a shared session.
pub(crate) struct MuxHold<C: LockConnection> {
    mux: Arc<Mux<C>>,
    session: Arc<MuxSession<C>>,
}

impl<C: LockConnection> Hold for MuxHold<C> {
    fn release(self: Box<Self>, key: &str) -> Result<bool> {
        let session = &self.session;
        let mut inner = session.inner.lock().unpoisoned();
        let released = if session.lost.load(Ordering::Acquire) {
            false
        } else if let Some(conn) = inner.conn.as_mut() {
            match conn.session_sql().and_then(|s| s.advisory_unlock(key)) {
                Ok(true) => true,
                Ok(false) => {
                    // The server says the session did not hold it: the session is not what
                    // we took it for. Closed, so that its other keys are not trusted.
                    log::warn!("lock {key:?}: its shared session no longer held it; the session is closed, every lock on it lost");
                    session.lose(&mut inner);
                    false
                }
                Err(e) => {
                    log::warn!("lock {key:?}: releasing failed ({e}); its shared session is closed, every lock on it lost");
                    session.lose(&mut inner);
                    false
                }
            }
        } else {
            false
        };
        inner.keys.remove(key);
        session.held.store(inner.keys.len(), Ordering::Relaxed);
        self.mux.finish(session, &mut inner, false);
        Ok(released)
    }

    fn held(&self, key: &str) -> Result<bool> {
        Ok(self.session.probe(key, Instant::now()))
    }

    fn probe(&self, key: &str, since: Instant) -> Result<bool> {
        Ok(self.session.probe(key, since))
    }

    fn keeps_connection(&self) -> bool {
        false
    }
}
