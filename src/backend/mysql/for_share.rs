//! MySQL's `ForUpdate` readers: the key's row locked in share mode, as `sessions.rs` locks it
//! `FOR UPDATE`, with the same token and the same proof. Writers need no mark here: InnoDB
//! queues a new share request behind a waiting exclusive one (see `backend/for_share.rs`).

use super::sessions::row_lock;
use crate::backend::for_share::ForShareLocks;
use crate::backend::sealed::SessionLocks;
use crate::backend::shared::One;
use crate::backend::stmt::stmt;
use crate::backend::{Flavor, ForUpdateLocked, Wait};
use diesel::mysql::MysqlConnection;
use diesel::sql_types::{BigInt, Text};
use diesel::{OptionalExtension, QueryResult, RunQueryDsl};

/// The reader's statements, as `FOR_UPDATE_LOCK` but for the locking clause: MariaDB's
/// `LOCK IN SHARE MODE`, MySQL's `FOR SHARE` (the only one of the two that takes `NOWAIT`
/// there).
macro_rules! share_lock {
    ($lock:literal) => {
        concat!(
            "SELECT \
             CAST(COALESCE(CAST(UUID_SHORT() & 72057594037927935 AS SIGNED) + IF(@@GLOBAL.server_id = @dlock_fence_server, @dlock_fence_off, NULL), -1) \
             AS SIGNED) AS token, \
             CAST(@dlock_fence_high AS SIGNED) AS high, \
             CAST(UNIX_TIMESTAMP(SYSDATE(6)) * 1000000 AS SIGNED) AS acquired_us \
             FROM dlock_for_update WHERE lock_key = ? ",
            $lock
        )
    };
}

impl ForShareLocks for MysqlConnection {
    fn for_share_lock(
        &mut self,
        key: &str,
        wait: Wait,
        flavor: Flavor,
    ) -> QueryResult<ForUpdateLocked> {
        let (locking, nowait) = match flavor {
            Flavor::Standard => (
                share_lock!("LOCK IN SHARE MODE"),
                share_lock!("LOCK IN SHARE MODE NOWAIT"),
            ),
            Flavor::Mysql => (share_lock!("FOR SHARE"), share_lock!("FOR SHARE NOWAIT")),
        };
        row_lock(self, key, wait, flavor, locking, nowait)
    }

    fn permits_setup(&mut self, key: &str, permits: i64, slots: bool) -> QueryResult<i64> {
        // A purge may delete a reader-writer kind (older than its grace, of a key with no
        // row) between the insert and the read: made again. Two inserts of a just-deleted
        // kind can deadlock (each holds a shared lock on the deleted record): run again.
        let stored = crate::backend::for_share::kind_made(key, || {
            match stmt(
                "INSERT IGNORE INTO dlock_shared_keys (lock_key, permit_count, token) VALUES (?, ?, 0)",
            )
            .bind::<Text, _>(key)
            .bind::<BigInt, _>(permits)
            .execute(self)
            {
                Ok(_) => {}
                Err(e) if super::contention(&e) => return Ok(None),
                Err(e) => return Err(e),
            }
            stmt(
                "SELECT CAST(permit_count AS SIGNED) AS one FROM dlock_shared_keys WHERE lock_key = ?",
            )
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
            && stmt(
                "SELECT CAST(COUNT(*) AS SIGNED) AS one FROM dlock_permit_slots WHERE lock_key = ?",
            )
            .bind::<Text, _>(key)
            .get_result::<One>(self)?
            .one < permits;
        if missing {
            // A recursive CTE counts 0 to N - 1 (at most 1,000 permits: MySQL's default
            // recursion limit).
            stmt(
                "INSERT IGNORE INTO dlock_permit_slots (lock_key, slot) \
                 WITH RECURSIVE g (n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM g WHERE n + 1 < ?) \
                 SELECT ?, n FROM g",
            )
            .bind::<BigInt, _>(permits)
            .bind::<Text, _>(key)
            .execute(self)?;
        }
        Ok(stored)
    }

    fn permit_slot_lock(&mut self, key: &str, flavor: Flavor) -> QueryResult<ForUpdateLocked> {
        // SKIP LOCKED never waits: the same text for every wait.
        const SLOT: &str = "SELECT \
             CAST(COALESCE(CAST(UUID_SHORT() & 72057594037927935 AS SIGNED) + IF(@@GLOBAL.server_id = @dlock_fence_server, @dlock_fence_off, NULL), -1) \
             AS SIGNED) AS token, \
             CAST(@dlock_fence_high AS SIGNED) AS high, \
             CAST(UNIX_TIMESTAMP(SYSDATE(6)) * 1000000 AS SIGNED) AS acquired_us \
             FROM dlock_permit_slots WHERE lock_key = ? ORDER BY slot LIMIT 1 FOR UPDATE SKIP LOCKED";
        row_lock(self, key, Wait::No, flavor, SLOT, SLOT)
    }

    fn permit_slots_free(&mut self, key: &str, upto: i64) -> QueryResult<i64> {
        // Autocommit: the share locks go with the statement.
        stmt(
            "SELECT CAST(COUNT(*) AS SIGNED) AS one FROM (SELECT slot FROM dlock_permit_slots \
             WHERE lock_key = ? ORDER BY slot LIMIT ? LOCK IN SHARE MODE SKIP LOCKED) s",
        )
        .bind::<Text, _>(key)
        .bind::<BigInt, _>(upto)
        .get_result::<One>(self)
        .map(|r| r.one)
    }

    fn for_share_held(&mut self, key: &str, proof: i64) -> QueryResult<bool> {
        self.for_update_held(key, proof)
    }

    fn for_share_finish(&mut self, proof: i64) -> QueryResult<bool> {
        self.for_update_finish(proof)
    }
}
