//! PostgreSQL's shared advisory locks (`pg_advisory_lock_shared`): the readers of an
//! `Advisory` `Locker`. As `advisory_lock` in `sessions.rs`: one statement takes the lock and
//! draws the token; a grant that raced `lock_timeout` is undone.
//!
//! Writers do not starve: PostgreSQL's lock manager makes a new request that conflicts with
//! a *waiting* one wait behind it (and a `pg_try_advisory_lock_shared` fail), so once a
//! writer waits on the server, new readers queue behind it.

use super::lock_timeout_ms;
use super::sessions::{advisory_lock_ids, LockedRow, Released};
use crate::backend::fence::secure;
use crate::backend::holders::SharedSessionLocks;
use crate::backend::sealed::SessionLocks;
use crate::backend::shared::{exists, One};
use crate::backend::stmt::stmt;
use crate::backend::{Acquired, Wait};
use diesel::pg::PgConnection;
use diesel::sql_types::{BigInt, Text};
use diesel::{OptionalExtension, QueryResult, RunQueryDsl};

impl SharedSessionLocks for PgConnection {
    fn advisory_lock_shared(&mut self, key: &str, wait: Wait) -> QueryResult<Option<Acquired>> {
        let k = crate::key_hash(key);
        let taken = match wait {
            Wait::No => stmt(
                "WITH l AS (SELECT set_config('synchronous_commit', 'off', true) AS s, \
                 pg_try_advisory_lock_shared(?) AS got) \
                 SELECT l.got, 0::int8 AS id, \
                 CASE WHEN l.got THEN nextval('dlock_fence_seq') + (SELECT off FROM dlock_fence_live) END \
                 AS token, (SELECT high FROM dlock_fence_live) AS high, \
                 clock_timestamp() AS acquired_at FROM l",
            )
            .bind::<BigInt, _>(k)
            .get_result::<LockedRow>(self),
            Wait::For(d) => stmt(
                "WITH l AS (SELECT set_config('synchronous_commit', 'off', true) AS s, \
                 CASE WHEN set_config('lock_timeout', ?, true) IS NOT NULL \
                 THEN pg_advisory_lock_shared(?) END AS got) \
                 SELECT true AS got, 0::int8 AS id, \
                 nextval('dlock_fence_seq') + (SELECT off FROM dlock_fence_live) AS token, \
                 (SELECT high FROM dlock_fence_live) AS high, clock_timestamp() AS acquired_at FROM l",
            )
            .bind::<Text, _>(lock_timeout_ms(d))
            .bind::<BigInt, _>(k)
            .get_result::<LockedRow>(self),
            Wait::Forever => stmt(
                "WITH l AS (SELECT set_config('synchronous_commit', 'off', true) AS s, \
                 pg_advisory_lock_shared(?) AS got) \
                 SELECT true AS got, 0::int8 AS id, \
                 nextval('dlock_fence_seq') + (SELECT off FROM dlock_fence_live) AS token, \
                 (SELECT high FROM dlock_fence_live) AS high, clock_timestamp() AS acquired_at FROM l",
            )
            .bind::<BigInt, _>(k)
            .get_result::<LockedRow>(self),
        };
        match taken {
            Ok(row) if !row.got => Ok(None),
            Ok(row) => {
                let token = secure(self, row.drawn())?;
                Ok(Some(Acquired {
                    id: 0,
                    token,
                    acquired_at: row.acquired_at,
                }))
            }
            Err(e) if self.is_lock_unavailable(&e) => {
                // A grant that came as lock_timeout fired stays with the session: undone.
                let (classid, objid) = advisory_lock_ids(key);
                let raced = stmt(
                    "SELECT pg_advisory_unlock_shared(?) AS released FROM pg_locks \
                     WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted \
                       AND mode = 'ShareLock' \
                       AND classid::int8 = ? AND objid::int8 = ? AND objsubid = 1",
                )
                .bind::<BigInt, _>(k)
                .bind::<BigInt, _>(classid)
                .bind::<BigInt, _>(objid)
                .get_result::<Released>(self)
                .optional()?;
                if raced.is_some_and(|r| r.released) {
                    log::debug!("lock {key:?}: a shared grant raced the wait's timeout; undone");
                }
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    fn advisory_unlock_shared(&mut self, key: &str) -> QueryResult<bool> {
        stmt("SELECT pg_advisory_unlock_shared(?) AS released")
            .bind::<BigInt, _>(crate::key_hash(key))
            .get_result::<Released>(self)
            .map(|r| r.released)
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
