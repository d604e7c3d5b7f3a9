//! PostgreSQL's shared advisory locks (`pg_advisory_lock_shared`): the readers of an
//! `Advisory` `Locker`. As `advisory_lock` in `sessions.rs`: one statement takes the lock and
//! draws the token; a grant that raced `lock_timeout` is undone.
//!
//! Writers do not starve: PostgreSQL's lock manager makes a new request that conflicts with
//! a *waiting* one wait behind it (and a `pg_try_advisory_lock_shared` fail), so once a
//! writer waits on the server, new readers queue behind it.

use super::sessions::{advisory_lock_ids, advisory_session_lock, Released, ADVISORY_SHARED};
use crate::backend::holders::SharedSessionLocks;
use crate::backend::shared::{exists, One};
use crate::backend::stmt::stmt;
use crate::backend::{Acquired, Wait};
use diesel::pg::PgConnection;
use diesel::sql_types::BigInt;
use diesel::{OptionalExtension, QueryResult, RunQueryDsl};

impl SharedSessionLocks for PgConnection {
    fn advisory_lock_shared(&mut self, key: &str, wait: Wait) -> QueryResult<Option<Acquired>> {
        advisory_session_lock(
            self,
            key,
            wait,
            &ADVISORY_SHARED,
            "SELECT pg_advisory_unlock_shared(?) AS released FROM pg_locks \
             WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted \
               AND mode = 'ShareLock' \
               AND classid::int8 = ? AND objid::int8 = ? AND objsubid = 1",
        )
    }

    fn advisory_unlock_shared(&mut self, key: &str) -> QueryResult<bool> {
        stmt("SELECT pg_advisory_unlock_shared(?) AS released")
            .bind::<BigInt, _>(crate::key_hash(key))
            .get_result::<Released>(self)
            .map(|r| r.released)
    }

    fn advisory_held_anywhere(&mut self, keys: &[String]) -> QueryResult<i64> {
        // A bigint advisory lock shows as classid (its high 32 bits) and objid (the low
        // ones) with objsubid 1.
        let hashes: Vec<i64> = keys.iter().map(|k| crate::key_hash(k)).collect();
        stmt(
            "SELECT count(*) AS one FROM pg_locks \
             WHERE locktype = 'advisory' AND granted AND objsubid = 1 \
               AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
               AND ((classid::int8 << 32) | objid::int8) = ANY(?)",
        )
        .bind::<diesel::sql_types::Array<BigInt>, _>(hashes)
        .get_result::<One>(self)
        .map(|r| r.one)
    }

    fn advisory_held_shared(&mut self, key: &str) -> QueryResult<bool> {
        let (classid, objid) = advisory_lock_ids(key);
        exists(
            stmt(
                "SELECT 1::int8 AS one FROM pg_locks \
                 WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted \
                   AND mode = 'ShareLock' \
                   AND classid::int8 = ? AND objid::int8 = ? AND objsubid = 1",
            )
            .bind::<BigInt, _>(classid)
            .bind::<BigInt, _>(objid)
            .get_result::<One>(self)
            .optional(),
        )
    }
}
