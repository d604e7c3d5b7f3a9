//! PostgreSQL's `ForUpdate` readers (`FOR SHARE`) and its writers' marks (see
//! `backend/for_share.rs`).

use super::lock_timeout_ms;
use super::sessions::{locked, LockedRow};
use crate::backend::for_share::ForShareLocks;
use crate::backend::shared::{exists, One};
use crate::backend::stmt::stmt;
use crate::backend::{Flavor, ForUpdateLocked, Wait};
use diesel::pg::PgConnection;
use diesel::sql_types::{BigInt, Text};
use diesel::{OptionalExtension, QueryResult, RunQueryDsl};

/// The locking statements, one per [`Wait`]: the subquery locks the row (a subquery with a
/// locking clause is never merged into the outer query), and the outer select list, run once
/// the row is locked, draws the token as `FOR_UPDATE_LOCK` does. The proof is the
/// transaction's id (a row lock gives the transaction one). `synchronous_commit` off: the
/// reader's COMMIT waits for no flush.
macro_rules! share_lock {
    ($lock:literal) => {
        concat!(
            "SELECT true AS got, txid_current() AS id, \
             nextval('dlock_fence_seq') + (SELECT off FROM dlock_fence_live) AS token, \
             (SELECT high FROM dlock_fence_live) AS high, clock_timestamp() AS acquired_at \
             FROM (SELECT lock_key FROM dlock_for_update WHERE lock_key = ? \
             AND set_config('synchronous_commit', 'off', true) IS NOT NULL ",
            $lock,
            ") s"
        )
    };
}

const SHARE_NOWAIT: &str = share_lock!("FOR SHARE NOWAIT");
const SHARE_WITHIN: &str =
    share_lock!("AND set_config('lock_timeout', ?, true) IS NOT NULL FOR SHARE");
const SHARE: &str = share_lock!("FOR SHARE");

impl ForShareLocks for PgConnection {
    fn for_share_lock(
        &mut self,
        key: &str,
        wait: Wait,
        _flavor: Flavor,
    ) -> QueryResult<ForUpdateLocked> {
        // A live writer's mark keeps new readers out (read committed: the mark is seen as
        // soon as it is committed).
        let marked = exists(
            stmt(
                "SELECT 1::int8 AS one FROM dlock_shared_keys \
                 WHERE lock_key = ? AND intent_until > clock_timestamp()",
            )
            .bind::<Text, _>(key)
            .get_result::<One>(self)
            .optional(),
        )?;
        if marked {
            return Ok(ForUpdateLocked::Blocked);
        }
        let row = match wait {
            Wait::No => stmt(SHARE_NOWAIT)
                .bind::<Text, _>(key)
                .get_result::<LockedRow>(self),
            Wait::For(d) => stmt(SHARE_WITHIN)
                .bind::<Text, _>(key)
                .bind::<Text, _>(lock_timeout_ms(d))
                .get_result::<LockedRow>(self),
            Wait::Forever => stmt(SHARE)
                .bind::<Text, _>(key)
                .get_result::<LockedRow>(self),
        }
        .optional()?;
        Ok(locked(row))
    }

    fn for_share_held(&mut self, _key: &str, proof: i64) -> QueryResult<bool> {
        // Row locks last until the transaction ends: the same transaction, still open,
        // still holds it.
        exists(
            stmt("SELECT 1::int8 AS one WHERE txid_current_if_assigned() = ?")
                .bind::<BigInt, _>(proof)
                .get_result::<One>(self)
                .optional(),
        )
    }

    fn for_share_finish(&mut self, proof: i64) -> QueryResult<bool> {
        self.for_share_held("", proof)
    }

    fn permits_setup(&mut self, key: &str, permits: i64, slots: bool) -> QueryResult<i64> {
        // A purge may delete a reader-writer kind (older than its grace, of a key with no
        // row) between the insert and the read: made again. So is an insert the server
        // rolled back: with sessions at REPEATABLE READ, ON CONFLICT DO NOTHING meeting a
        // row committed after the statement's snapshot (another first acquisition's insert,
        // a writer's mark) is a serialization failure, which reached the caller (an
        // adversary: 246 of 400 first readers of one key); run again, it takes a new
        // snapshot and sees the row.
        let stored = crate::backend::for_share::kind_made(key, || {
            let made = stmt(
                "INSERT INTO dlock_shared_keys (lock_key, permit_count, token) VALUES (?, ?, 0) \
                 ON CONFLICT (lock_key) DO NOTHING",
            )
            .bind::<Text, _>(key)
            .bind::<BigInt, _>(permits)
            .execute(self);
            match made {
                Err(e) if super::rolled_back(&e) => {
                    log::debug!("lock {key:?}: making its kind was rolled back ({e}); again");
                    return Ok(None);
                }
                made => made?,
            };
            stmt("SELECT permit_count AS one FROM dlock_shared_keys WHERE lock_key = ?")
                .bind::<Text, _>(key)
                .get_result::<One>(self)
                .optional()
                .map(|r| r.map(|r| r.one))
        })?;
        // Only a key without all its slots inserts them: a duplicate that a holder has
        // locked would make the insert wait for that holder (InnoDB's duplicate check takes
        // a lock on it), and the count is a plain read that waits for nobody.
        let missing = slots
            && stored == permits
            && stmt("SELECT count(*) AS one FROM dlock_permit_slots WHERE lock_key = ?")
                .bind::<Text, _>(key)
                .get_result::<One>(self)?
                .one
                < permits;
        if missing {
            // Rolled back at REPEATABLE READ as the kind's insert can be: run again.
            crate::backoff::retry_contended(
                self,
                std::time::Duration::from_millis(16),
                "making a key's permit slots",
                |c| {
                    stmt(
                        "INSERT INTO dlock_permit_slots (lock_key, slot) \
                         SELECT ?, g FROM generate_series(0, ?::int4 - 1) g \
                         ON CONFLICT (lock_key, slot) DO NOTHING",
                    )
                    .bind::<Text, _>(key)
                    .bind::<BigInt, _>(permits)
                    .execute(c)
                },
                |_, e| super::rolled_back(e),
            )?;
        }
        Ok(stored)
    }

    fn permit_slot_lock(&mut self, key: &str, _flavor: Flavor) -> QueryResult<ForUpdateLocked> {
        let row = stmt(
            "SELECT true AS got, txid_current() AS id, \
             nextval('dlock_fence_seq') + (SELECT off FROM dlock_fence_live) AS token, \
             (SELECT high FROM dlock_fence_live) AS high, clock_timestamp() AS acquired_at \
             FROM (SELECT slot FROM dlock_permit_slots WHERE lock_key = ? \
             AND set_config('synchronous_commit', 'off', true) IS NOT NULL \
             ORDER BY slot LIMIT 1 FOR UPDATE SKIP LOCKED) s",
        )
        .bind::<Text, _>(key)
        .get_result::<LockedRow>(self)
        .optional()?;
        Ok(locked(row))
    }

    fn permit_slots_free(&mut self, key: &str, upto: i64) -> QueryResult<i64> {
        stmt(
            "SELECT count(*) AS one FROM (SELECT slot FROM dlock_permit_slots \
             WHERE lock_key = ? ORDER BY slot LIMIT ? FOR SHARE SKIP LOCKED) s",
        )
        .bind::<Text, _>(key)
        .bind::<BigInt, _>(upto)
        .get_result::<One>(self)
        .map(|r| r.one)
    }

    fn needs_writer_mark(&self) -> bool {
        true
    }

    fn mark_writer(&mut self, key: &str, writer: &str, ttl_us: i64) -> QueryResult<()> {
        // The key's header row (created as a reader-writer key's, permits 0, if it has
        // none) carries at most one writer's mark; another writer's live mark stays.
        stmt(
            "INSERT INTO dlock_shared_keys AS k (lock_key, permit_count, token, intent, intent_until) \
             VALUES (?, 0, 0, ?, clock_timestamp() + ? * interval '1 microsecond') \
             ON CONFLICT (lock_key) DO UPDATE \
             SET intent = EXCLUDED.intent, intent_until = EXCLUDED.intent_until \
             WHERE k.intent IS NULL OR k.intent = EXCLUDED.intent \
                OR k.intent_until IS NULL OR k.intent_until <= clock_timestamp()",
        )
        .bind::<Text, _>(key)
        .bind::<Text, _>(writer)
        .bind::<BigInt, _>(ttl_us)
        .execute(self)
        .map(drop)
    }

    fn unmark_writer(&mut self, key: &str, writer: &str) -> QueryResult<()> {
        stmt(
            "UPDATE dlock_shared_keys SET intent = NULL, intent_until = NULL \
             WHERE lock_key = ? AND intent = ?",
        )
        .bind::<Text, _>(key)
        .bind::<Text, _>(writer)
        .execute(self)
        .map(drop)
    }
}
