//! MySQL's `ForUpdate` readers: the key's row locked in share mode, as `sessions.rs` locks it
//! `FOR UPDATE`, with the same token and the same proof. Writers need no mark here: InnoDB
//! queues a new share request behind a waiting exclusive one (see `backend/for_share.rs`).

use super::sessions::row_lock;
use crate::backend::for_share::ForShareLocks;
use crate::backend::sealed::SessionLocks;
use crate::backend::{Flavor, ForUpdateLocked, Wait};
use diesel::mysql::MysqlConnection;
use diesel::QueryResult;

/// The reader's statements, as `FOR_UPDATE_LOCK` but for the locking clause: MariaDB's
/// `LOCK IN SHARE MODE`, MySQL's `FOR SHARE` (the only one of the two that takes `NOWAIT`
/// there).
macro_rules! share_lock {
    ($lock:literal) => {
        concat!(
            "SELECT \
             CAST(COALESCE(CAST(UUID_SHORT() & 72057594037927935 AS SIGNED) + @dlock_fence_off, -1) \
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

    fn for_share_held(&mut self, key: &str, proof: i64) -> QueryResult<bool> {
        self.for_update_held(key, proof)
    }

    fn for_share_finish(&mut self, proof: i64) -> QueryResult<bool> {
        self.for_update_finish(proof)
    }
}
