//! `Strategy::Row`: the lock is a row on a unique key; release deletes it by id and holder id.

use super::{check_duration, contention_is_busy, micros, with_conn, Hold, Pool, RawLock, Setup};
use super::{Conn, Taken};
use crate::backend::{Acquired, LockConnection, PurgeTable, Sql, Wait};
use crate::sync::Unpoison;
use crate::Result;
use std::sync::Mutex;
use std::time::Duration;

pub(super) struct RowLock<C: LockConnection> {
    pool: Pool<C>,
    owner: String,
    /// The staleness limit stored with each row this `Locker` inserts (`stale_at`), in
    /// microseconds; `None`: its rows never go stale.
    stale_us: Option<i64>,
    /// Rows this `Locker` may have inserted but could not delete after the acquisition failed
    /// (the connection died between the INSERT's commit and its reply, and the clean-up found
    /// no working connection either: a database restarting, say): `(key, holder)`. The next
    /// attempt on the key deletes them first, so that a waiter riding out the outage does not
    /// wait forever for a row that nobody holds.
    orphans: Mutex<Vec<(String, String)>>,
}

impl<C: LockConnection> RowLock<C> {
    pub(super) fn new(setup: Setup<C>, stale_after: Option<Duration>) -> Result<Self> {
        if let Some(d) = stale_after {
            check_duration(d, "stale_after (when set)")?;
        }
        Ok(RowLock {
            pool: setup.pool,
            owner: setup.owner,
            stale_us: stale_after.map(|d| micros(d).unwrap_or(i64::MAX)),
            orphans: Mutex::new(Vec::new()),
        })
    }

    /// The backend's insert. An error other than contention may come after the INSERT
    /// committed (a reply lost with the connection): the row, if any, is then deleted by its
    /// holder id, so that no lock is left that nobody holds. A missing table leaves nothing
    /// to clean up.
    fn insert(
        &self,
        conn: &mut Conn<C>,
        key: &str,
        holder: &str,
        retry: bool,
    ) -> Result<Option<Acquired>> {
        let place = conn.place;
        let inserted =
            conn.sql()
                .row_acquire(key, &self.owner, holder, self.stale_us, retry, place);
        match inserted {
            Err(e) if !conn.sql().is_contention(&e) && may_have_committed(&e) => {
                // On this same connection if it still works (a second pooled connection,
                // taken while holding this one, would wait out the pool's timeout on a pool
                // of one); else on another.
                let cleanup = conn
                    .sql()
                    .row_forget(key, holder)
                    .map_err(crate::Error::from)
                    .or_else(|_| with_conn(&self.pool, |c| c.sql().row_forget(key, holder)));
                match cleanup {
                    Ok(true) => log::warn!("lock {key:?}: acquiring failed ({e}) after the row was inserted; the row was removed"),
                    Ok(false) => {}
                    Err(cleanup) => {
                        log::warn!(
                            "lock {key:?}: acquiring failed ({e}), and removing a row it may have left failed too ({cleanup}); the next attempt on the key tries again"
                        );
                        self.orphans().push((key.to_owned(), holder.to_owned()));
                    }
                }
                Err(e.into())
            }
            other => Ok(other?),
        }
    }
}

/// Whether a failed acquisition may have left its row behind: always, except when a table or
/// column is missing (nothing could be inserted then). On MySQL the row is read back by a
/// second statement, so even an error the server sent may come after the INSERT committed.
fn may_have_committed(e: &diesel::result::Error) -> bool {
    !crate::error::is_missing_table(e)
}

impl<C: LockConnection> RawLock<C> for RowLock<C> {
    fn try_acquire(
        &self,
        conn: &mut Conn<C>,
        key: &str,
        retry: bool,
        _wait: Wait,
    ) -> Result<Option<Taken>> {
        let attempt = self.attempt(conn, key, retry);
        contention_is_busy(&mut **conn, key, attempt)
    }

    fn line(&self) -> Option<crate::backend::Line> {
        Some(crate::backend::Line::Row)
    }

    fn give_back(&self, conn: &mut C, key: &str, holder: &str) -> Result<()> {
        if conn.sql().row_give_back(key, holder)? {
            log::debug!("lock {key:?}: gave back the key granted as its wait ended");
        }
        Ok(())
    }

    fn purge(&self, _idle: Duration) -> Result<usize> {
        // Rows past their own `stale_at`, which any waiter could take over anyway. One
        // statement; a deadlock victim's was rolled back and is run again.
        let rows = with_conn(&self.pool, |c| c.sql().purge_stale_rows())?;
        // Places of dead waiters (ignored by everyone once lapsed; not counted as locks).
        with_conn(&self.pool, |c| c.sql().purge_lapsed_places())?;
        // The counters of keys nobody holds (the token floor is raised first).
        let counters = super::purge::released_keys(&self.pool, &[PurgeTable::Counters], 0)?;
        Ok(rows + counters)
    }
}

impl<C: LockConnection> RowLock<C> {
    fn orphans(&self) -> std::sync::MutexGuard<'_, Vec<(String, String)>> {
        self.orphans.lock().unpoisoned()
    }

    /// Deletes the rows of `key` that failed acquisitions may have left (see `orphans`);
    /// those it cannot delete yet stay listed.
    fn forget_orphans(&self, conn: &mut Conn<C>, key: &str) -> Result<()> {
        let mine: Vec<String> = {
            let mut orphans = self.orphans();
            if orphans.is_empty() {
                return Ok(());
            }
            let (mine, rest) = orphans.drain(..).partition(|(k, _)| k == key);
            *orphans = rest;
            mine.into_iter().map(|(_, holder)| holder).collect()
        };
        for (i, holder) in mine.iter().enumerate() {
            match conn.sql().row_forget(key, holder) {
                Ok(true) => {
                    log::warn!("lock {key:?}: removed the row a failed acquisition had left")
                }
                Ok(false) => {}
                Err(e) => {
                    let left = mine[i..].iter().map(|h| (key.to_owned(), h.clone()));
                    self.orphans().extend(left);
                    return Err(e.into());
                }
            }
        }
        Ok(())
    }

    fn attempt(&self, conn: &mut Conn<C>, key: &str, retry: bool) -> Result<Option<Taken>> {
        self.forget_orphans(conn, key)?;
        let holder = conn.holder.clone().unwrap_or_else(crate::random::holder_id);
        if conn.granted.is_some() {
            // A release gave this waiter's place the key: confirm within its deadline.
            let place = conn.place;
            return Ok(self
                .confirm(conn, key, place, &holder)?
                .map(|a| self.taken(a, &holder, true)));
        }
        if let Some(a) = self.insert(conn, key, &holder, retry)? {
            return Ok(Some(self.taken(a, &holder, false)));
        }
        // The holder's row goes stale only past the limit its *holder* set (never, without
        // one), whatever this Locker's own `stale_after` says. One conditional DELETE removes
        // it only if it is still the stale one: a row that replaced it in the meantime has its
        // own, later `stale_at` and survives. After it, every taker competes with an ordinary
        // insert, so only one of them wins.
        if conn.sql().row_delete_stale(key)? {
            log::warn!(
                "lock {key:?}: took over a row past its holder's stale_after (its holder is presumed dead)"
            );
            return Ok(self
                .insert(conn, key, &holder, false)?
                .map(|a| self.taken(a, &holder, false)));
        }
        Ok(None)
    }

    /// Confirms the grant of `key` to place `place` (`Locks::row_confirm`). A confirmation
    /// that the server rolled back (a deadlock's victim; on a Galera node, a certification
    /// conflict: `Dialect::is_rolled_back`) did nothing, and the grant still stands: it runs
    /// again (at most 9 runs, pauses of 1–16 ms). Reported busy, the wait took it for a
    /// lapsed grant and passed the key on to the next in line (tests/galera.rs
    /// `waiters_on_different_nodes_are_served_in_line` saw that).
    fn confirm(
        &self,
        conn: &mut Conn<C>,
        key: &str,
        place: i64,
        holder: &str,
    ) -> diesel::QueryResult<Option<Acquired>> {
        crate::backoff::retry_contended(
            &mut **conn,
            Duration::from_millis(16),
            "confirming a grant",
            |c| {
                #[cfg(feature = "test-hooks")]
                crate::hooks::before_confirm(key);
                c.sql().row_confirm(key, place, holder, self.stale_us)
            },
            |c, e| c.sql().is_rolled_back(e),
        )
    }

    /// The hold of row `a`; `granted`: a release handed it over (see `RowHold::granted`).
    fn taken(&self, a: Acquired, holder: &str, granted: bool) -> Taken {
        Taken {
            hold: Box::new(RowHold {
                pool: self.pool.clone(),
                id: a.id,
                holder: holder.to_owned(),
                granted,
            }),
            token: a.token,
            acquired_at: a.acquired_at,
        }
    }
}

/// A held row, known by its id and its holder id: both must match, since an id can be
/// handed out again after a failover to a standby that had not seen the row.
struct RowHold<C: LockConnection> {
    pool: Pool<C>,
    id: i64,
    holder: String,
    /// A release handed this row over (others were in line): its own release hands it on
    /// at once (`Locks::row_release_granted`).
    granted: bool,
}

impl<C: LockConnection> Hold for RowHold<C> {
    fn release(self: Box<Self>, _key: &str) -> Result<bool> {
        with_conn(&self.pool, |c| {
            if self.granted {
                c.sql().row_release_granted(self.id, &self.holder)
            } else {
                c.sql().row_release(self.id, &self.holder)
            }
        })
    }

    fn held(&self, _key: &str) -> Result<bool> {
        with_conn(&self.pool, |c| c.sql().row_held(self.id, &self.holder))
    }
}
