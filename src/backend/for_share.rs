//! The readers of a `ForUpdate` `Locker` (`SELECT … FOR SHARE` / `LOCK IN SHARE MODE` on the
//! key's row, in a transaction the guard keeps open), and the mark by which its writers keep
//! new readers out on PostgreSQL. Each backend's statements are in its `for_share.rs`.
//!
//! Writers are the strategy's own `FOR UPDATE` on the same row. InnoDB queues a new share
//! request behind a waiting exclusive one, so on MySQL a waiting writer keeps new readers
//! out by itself. PostgreSQL does not: a new `FOR SHARE` is granted beside the sharers while
//! a `FOR UPDATE` waits (tried on PostgreSQL 15), so a stream of readers could keep a
//! writer out for ever. There a waiting writer first marks the key (`intent` and
//! `intent_until` of `dlock_shared_keys`, committed at once, on the database clock), and a
//! reader that finds a live mark does not take the row: it waits, as for a held key.
//!
//! The same trait has what the session strategies' semaphores need: the key's number of
//! permits, kept as a `Lease` semaphore's, and `ForUpdate`'s slot rows (`dlock_permit_slots`).

use super::{ForUpdateLocked, Wait};
use diesel::QueryResult;

/// See the module docs.
pub trait ForShareLocks {
    /// Inside the transaction the caller opened: locks the key's row in share mode, waiting
    /// as `wait` says, and draws a token as `SessionLocks::for_update_lock` does (from the
    /// global source, once the row is locked). `Blocked` while another writer's mark is live
    /// (PostgreSQL); `Missing` if the key has no row yet. Busy: an error that
    /// `SessionLocks::is_lock_unavailable` recognises.
    fn for_share_lock(
        &mut self,
        key: &str,
        wait: Wait,
        flavor: super::Flavor,
    ) -> QueryResult<ForUpdateLocked>;
    /// Inside the holder's transaction: does it still hold the share lock it took with
    /// `proof`?
    fn for_share_held(&mut self, key: &str, proof: i64) -> QueryResult<bool>;
    /// Just before COMMIT: false if the transaction no longer holds the lock.
    fn for_share_finish(&mut self, proof: i64) -> QueryResult<bool>;
    /// Semaphores of the session strategies, outside any transaction: makes `key` a
    /// semaphore of `permits` unless it is a key already (its row in `dlock_shared_keys`, as
    /// a `Lease` semaphore's), and with `slots` (`ForUpdate`) makes its slot rows; returns
    /// the number of permits the key has (another number: the caller refuses).
    fn permits_setup(&mut self, key: &str, permits: i64, slots: bool) -> QueryResult<i64>;
    /// `ForUpdate`'s permits, inside the transaction the caller opened: locks a free slot
    /// row of `key` (`FOR UPDATE SKIP LOCKED`: never waits) and draws a token as
    /// `for_share_lock` does, with the same proof; `Missing` when every slot is taken.
    fn permit_slot_lock(
        &mut self,
        key: &str,
        flavor: super::Flavor,
    ) -> QueryResult<ForUpdateLocked>;
    /// `ForUpdate`'s permits, outside any transaction: how many of `key`'s slot rows no
    /// holder has locked, counting at most `upto` (one statement that locks the free ones
    /// in share mode, `SKIP LOCKED`, and lets them go as it ends: a holder's `FOR UPDATE`
    /// is the one lock it skips; a slot another waiter tries at that very instant may be
    /// skipped by either, which only makes that try busy).
    fn permit_slots_free(&mut self, key: &str, upto: i64) -> QueryResult<i64>;
    /// True where a waiting writer must mark the key to keep new readers out (PostgreSQL).
    fn needs_writer_mark(&self) -> bool {
        false
    }
    /// Outside any transaction: marks `writer` as waiting for `key` for `ttl_us`, committed
    /// at once, unless another writer's mark is live.
    fn mark_writer(&mut self, key: &str, writer: &str, ttl_us: i64) -> QueryResult<()> {
        let _ = (key, writer, ttl_us);
        Ok(())
    }
    /// Outside any transaction: removes `writer`'s mark, if it is still there.
    fn unmark_writer(&mut self, key: &str, writer: &str) -> QueryResult<()> {
        let _ = (key, writer);
        Ok(())
    }
}

/// `ForShareLocks::permits_setup`'s first step, written once: `make` inserts the key's kind
/// unless it has one and reads its number of permits (`None`: the row was not there when
/// read, deleted by a purge since the insert, or the insert met contention); run again until
/// it reads one, at most 16 times (each time a purge must have deleted the kind since).
pub(crate) fn kind_made(
    key: &str,
    mut make: impl FnMut() -> QueryResult<Option<i64>>,
) -> QueryResult<i64> {
    for _ in 0..16 {
        if let Some(permits) = make()? {
            return Ok(permits);
        }
        log::debug!("lock {key:?}: its kind was deleted as it was made; again");
    }
    Err(diesel::result::Error::QueryBuilderError(
        format!("the kind of {key:?} was deleted 16 times as it was made").into(),
    ))
}
