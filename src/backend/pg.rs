//! PostgreSQL: every acquire and every release is one statement.

use super::sealed::{Dialect, Seal, Sealed, SessionLocks};
use super::stmt::stmt;
use super::{force_release_in, migrate_with_retry, Acquired, Backend, Held, Wait};
use crate::admin::LockInfo;
use crate::{Error, Result};
use chrono::{DateTime, Utc};
use diesel::pg::PgConnection;
use diesel::sql_types::{BigInt, Bool, Nullable, Text, Timestamptz};
use diesel::Connection;
use diesel::{OptionalExtension, QueryResult, QueryableByName, RunQueryDsl};
use diesel_migrations::{embed_migrations, EmbeddedMigrations, MigrationHarness};

const MIGRATIONS: EmbeddedMigrations = embed_migrations!("migrations/postgres");

/// Serialises concurrent `migrate()` calls across processes (key_hash("diesel-lock/migrate")
/// is not needed here: any constant outside the range users pick by hand will do).
const MIGRATION_LOCK: i64 = 0x646c_6f63_6b5f_6d69; // "dlock_mi"

#[derive(QueryableByName)]
struct AcquiredRow {
    #[diesel(sql_type = BigInt)]
    id: i64,
    #[diesel(sql_type = BigInt)]
    token: i64,
    #[diesel(sql_type = Timestamptz)]
    acquired_at: DateTime<Utc>,
}

impl From<AcquiredRow> for Acquired {
    fn from(r: AcquiredRow) -> Self {
        Acquired {
            id: r.id,
            token: r.token,
            acquired_at: r.acquired_at,
        }
    }
}

#[derive(QueryableByName)]
struct Released {
    #[diesel(sql_type = Bool)]
    released: bool,
}

/// `lock_timeout` as PostgreSQL reads it: whole milliseconds, rounded up so that the server
/// never gives up before the caller's deadline; at least 1, because 0 means "no limit"; at
/// most 2147483647 (~24.8 days), the largest it accepts: a longer wait ends there as busy,
/// and the locker waits again until its deadline.
fn lock_timeout_ms(d: std::time::Duration) -> String {
    let ms = d.as_micros().div_ceil(1000).clamp(1, i32::MAX as u128);
    ms.to_string()
}

/// pg_locks shows an advisory lock taken with one bigint key as classid = high 32 bits,
/// objid = low 32 bits (both oids, so unsigned) and objsubid = 1.
fn advisory_lock_ids(key: &str) -> (i64, i64) {
    let k = crate::key_hash(key);
    (i64::from((k >> 32) as u32), i64::from(k as u32))
}

#[derive(QueryableByName)]
struct One {
    #[diesel(sql_type = BigInt)]
    one: i64,
}

/// True if `e` says the lock is someone else's (see `Dialect::is_lock_unavailable`).
fn lock_unavailable(e: &diesel::result::Error) -> bool {
    // Both cases are SQLSTATE 55P03 (lock_not_available), but diesel keeps no SQLSTATE
    // for it (DatabaseErrorKind::Unknown), so the primary message is matched. These
    // are the server's English texts: a server whose lc_messages translates them makes
    // a busy lock surface as Error::Database, never as a false success.
    // - NOWAIT: `could not obtain lock on row in relation "dlock_for_update"`
    // - lock_timeout: `canceling statement due to lock timeout`
    //   (statement_timeout says "due to statement timeout" and is a real error)
    match e {
        diesel::result::Error::DatabaseError(_, info) => {
            let m = info.message();
            m.starts_with("could not obtain lock on row")
                || m.starts_with("canceling statement due to lock timeout")
        }
        _ => false,
    }
}

super::held_row!(Timestamptz, DateTime<Utc>, |t| t);

impl Dialect for PgConnection {
    super::same_sql_everywhere!();

    fn backend(&self) -> Backend {
        Backend::Postgres
    }

    fn run_migrations(&mut self) -> Result<()> {
        stmt("SELECT pg_advisory_lock(?)")
            .bind::<BigInt, _>(MIGRATION_LOCK)
            .execute(self)?;
        // One transaction for all of them (diesel runs each in a savepoint inside it): DDL is
        // transactional here, so other sessions see the old schema or the new, never half.
        let result = migrate_with_retry(self, |c| {
            c.transaction(|c| {
                c.run_pending_migrations(MIGRATIONS)
                    .map(drop)
                    .map_err(Error::Migration)
            })
        });
        let unlocked = stmt("SELECT pg_advisory_unlock(?)")
            .bind::<BigInt, _>(MIGRATION_LOCK)
            .execute(self);
        result?;
        unlocked?;
        Ok(())
    }

    fn is_contention(&self, e: &diesel::result::Error) -> bool {
        use diesel::result::{DatabaseErrorKind, Error as E};
        match e {
            E::DatabaseError(DatabaseErrorKind::SerializationFailure, _) => true,
            // 40P01 deadlock_detected and 55P03 lock_not_available have no diesel kind.
            E::DatabaseError(_, info) => {
                let m = info.message();
                m.starts_with("deadlock detected") || lock_unavailable(e)
            }
            _ => false,
        }
    }

    fn row_acquire(
        &mut self,
        key: &str,
        owner: &str,
        holder: &str,
        stale_us: Option<i64>,
        _retry: bool,
    ) -> QueryResult<Option<Acquired>> {
        // The token counter's row lock serialises every transaction that can insert the
        // key's row, so tokens are handed out in the order the rows are inserted and a later
        // holder always has a larger token (an id from a sequence would not: nextval runs
        // before the unique check, so a slow inserter can win with an older id).
        // While the row is visibly held, the counter is not touched at all. The times are
        // clock_timestamp(): now() is when the statement began, before any wait for the
        // counter's row lock.
        stmt(
            "WITH t AS ( \
               INSERT INTO dlock_tokens AS t (lock_key, token) \
               SELECT ?, 1 WHERE NOT EXISTS (SELECT 1 FROM dlock_rows WHERE lock_key = ?) \
               ON CONFLICT (lock_key) DO UPDATE SET token = t.token + 1 \
               RETURNING token) \
             INSERT INTO dlock_rows (lock_key, owner, holder, token, acquired_at, stale_at) \
             SELECT ?, ?, ?, t.token, clock_timestamp(), clock_timestamp() + ? * interval '1 microsecond' FROM t \
             ON CONFLICT (lock_key) DO NOTHING \
             RETURNING id, token, acquired_at",
        )
        .bind::<Text, _>(key)
        .bind::<Text, _>(key)
        .bind::<Text, _>(key)
        .bind::<Text, _>(owner)
        .bind::<Text, _>(holder)
        .bind::<Nullable<BigInt>, _>(stale_us)
        .get_result::<AcquiredRow>(self)
        .optional()
        .map(|r| r.map(Into::into))
    }

    fn row_forget(&mut self, key: &str, holder: &str) -> QueryResult<bool> {
        stmt("DELETE FROM dlock_rows WHERE lock_key = ? AND holder = ?")
            .bind::<Text, _>(key)
            .bind::<Text, _>(holder)
            .execute(self)
            .map(|n| n > 0)
    }

    fn row_delete_stale(&mut self, key: &str) -> QueryResult<bool> {
        // The subquery is a plain snapshot read; the DELETE then locks only that row, by id,
        // and re-checks it: a row deleted and re-inserted meanwhile has another id.
        stmt(
            "DELETE FROM dlock_rows WHERE id = (SELECT id FROM dlock_rows WHERE lock_key = ? \
             AND stale_at <= now())",
        )
        .bind::<Text, _>(key)
        .execute(self)
        .map(|n| n > 0)
    }

    fn row_release(&mut self, id: i64) -> QueryResult<bool> {
        // The notification wakes waiters whose Locker listens (pg_listen.rs); it is sent at
        // commit, so it never arrives before the row is gone.
        stmt(
            "WITH d AS (DELETE FROM dlock_rows WHERE id = ? RETURNING lock_key) \
             SELECT count(pg_notify('dlock_release', lock_key)) AS one FROM d",
        )
        .bind::<BigInt, _>(id)
        .get_result::<One>(self)
        .map(|r| r.one == 1)
    }

    fn row_held(&mut self, id: i64) -> QueryResult<bool> {
        stmt("SELECT 1::int8 AS one FROM dlock_rows WHERE id = ?")
            .bind::<BigInt, _>(id)
            .get_result::<One>(self)
            .optional()
            .map(|r| r.is_some())
    }

    fn lease_acquire(
        &mut self,
        key: &str,
        owner: &str,
        holder: &str,
        ttl_us: i64,
        _retry: bool,
    ) -> QueryResult<Option<Acquired>> {
        // One statement. If its snapshot shows the key's row, `u` takes it over when free or
        // expired: an UPDATE re-checks the row's newest version after any wait, so the token
        // it bumps is the latest. If the snapshot shows no row, `t` bumps the key's counter
        // in dlock_tokens (an upsert also acts on the newest version, and locks it) and `i`
        // inserts the row with that token. A row deleted by `purge` after the snapshot makes
        // `u` find nothing and `t` not run: the attempt fails and is retried with a fresh
        // snapshot, never with a token read before the purge saved the row's last one.
        // The new times are clock_timestamp(), not now() (the statement's start): `u` may
        // wait for another transaction's update of the row, `t` for the counter's row lock.
        // An expiry a little later than the caller's own count (from before it sent the
        // statement) is on the safe side.
        stmt(
            "WITH u AS ( \
               UPDATE dlock_leases SET owner = ?, holder = ?, token = token + 1, \
                 acquired_at = clock_timestamp(), expires_at = clock_timestamp() + ? * interval '1 microsecond' \
               WHERE lock_key = ? AND (holder IS NULL OR expires_at <= now()) \
               RETURNING token, acquired_at), \
             t AS ( \
               INSERT INTO dlock_tokens AS t (lock_key, token) \
               SELECT ?, 1 WHERE NOT EXISTS (SELECT 1 FROM dlock_leases WHERE lock_key = ?) \
               ON CONFLICT (lock_key) DO UPDATE SET token = t.token + 1 \
               RETURNING token), \
             i AS ( \
               INSERT INTO dlock_leases (lock_key, owner, holder, token, acquired_at, expires_at) \
               SELECT ?, ?, ?, t.token, clock_timestamp(), clock_timestamp() + ? * interval '1 microsecond' FROM t \
               ON CONFLICT (lock_key) DO NOTHING \
               RETURNING token, acquired_at) \
             SELECT 0::int8 AS id, token, acquired_at FROM u \
             UNION ALL SELECT 0::int8 AS id, token, acquired_at FROM i",
        )
        .bind::<Text, _>(owner)
        .bind::<Text, _>(holder)
        .bind::<BigInt, _>(ttl_us)
        .bind::<Text, _>(key)
        .bind::<Text, _>(key)
        .bind::<Text, _>(key)
        .bind::<Text, _>(key)
        .bind::<Text, _>(owner)
        .bind::<Text, _>(holder)
        .bind::<BigInt, _>(ttl_us)
        .get_result::<AcquiredRow>(self)
        .optional()
        .map(|r| r.map(Into::into))
    }

    fn lease_renew(
        &mut self,
        key: &str,
        holder: &str,
        ttl_us: i64,
        bound: std::time::Duration,
    ) -> QueryResult<bool> {
        // set_config(.., true) lasts until the end of this statement's own transaction, and
        // runs (on the row's filter) before the UPDATE waits for another session's row lock.
        stmt(
            "UPDATE dlock_leases SET expires_at = now() + ? * interval '1 microsecond' \
             WHERE lock_key = ? AND holder = ? \
               AND set_config('lock_timeout', ?, true) IS NOT NULL AND expires_at > now()",
        )
        .bind::<BigInt, _>(ttl_us)
        .bind::<Text, _>(key)
        .bind::<Text, _>(holder)
        .bind::<Text, _>(lock_timeout_ms(bound))
        .execute(self)
        .map(|n| n == 1)
    }

    fn lease_release(&mut self, key: &str, holder: &str) -> QueryResult<bool> {
        stmt(
            "WITH u AS (UPDATE dlock_leases SET holder = NULL, expires_at = NULL \
                        WHERE lock_key = ? AND holder = ? RETURNING lock_key) \
             SELECT count(pg_notify('dlock_release', lock_key)) AS one FROM u",
        )
        .bind::<Text, _>(key)
        .bind::<Text, _>(holder)
        .get_result::<One>(self)
        .map(|r| r.one == 1)
    }

    fn lease_held(&mut self, key: &str, holder: &str) -> QueryResult<bool> {
        stmt(
            "SELECT 1::int8 AS one FROM dlock_leases \
             WHERE lock_key = ? AND holder = ? AND expires_at > now()",
        )
        .bind::<Text, _>(key)
        .bind::<Text, _>(holder)
        .get_result::<One>(self)
        .optional()
        .map(|r| r.is_some())
    }

    fn version_create(&mut self, key: &str) -> QueryResult<()> {
        stmt(
            "INSERT INTO dlock_versions (lock_key, version) VALUES (?, 0) \
             ON CONFLICT (lock_key) DO NOTHING",
        )
        .bind::<Text, _>(key)
        .execute(self)
        .map(drop)
    }

    fn admin_rows(&mut self, key: Option<&str>) -> QueryResult<Vec<Held>> {
        let rows = match key {
            None => stmt(
                "SELECT id, NULL::text AS holder, lock_key, owner, token, acquired_at, \
                        NULL::timestamptz AS expires_at, now() AS observed_at \
                 FROM dlock_rows ORDER BY lock_key",
            )
            .load(self),
            Some(key) => stmt(
                "SELECT id, NULL::text AS holder, lock_key, owner, token, acquired_at, \
                        NULL::timestamptz AS expires_at, now() AS observed_at \
                 FROM dlock_rows WHERE lock_key = ?",
            )
            .bind::<Text, _>(key)
            .load(self),
        };
        held(rows, "row")
    }

    fn admin_leases(&mut self, key: Option<&str>) -> QueryResult<Vec<Held>> {
        let rows = match key {
            None => stmt(
                "SELECT 0::int8 AS id, holder, lock_key, COALESCE(owner, '') AS owner, token, \
                        acquired_at, expires_at, now() AS observed_at \
                 FROM dlock_leases \
                 WHERE holder IS NOT NULL AND holder <> '' AND expires_at > now() AND acquired_at IS NOT NULL \
                 ORDER BY lock_key",
            )
            .load(self),
            Some(key) => stmt(
                "SELECT 0::int8 AS id, holder, lock_key, COALESCE(owner, '') AS owner, token, \
                        acquired_at, expires_at, now() AS observed_at \
                 FROM dlock_leases \
                 WHERE lock_key = ? AND holder IS NOT NULL AND holder <> '' AND expires_at > now() \
                   AND acquired_at IS NOT NULL",
            )
            .bind::<Text, _>(key)
            .load(self),
        };
        held(rows, "lease")
    }

    fn admin_force_release(&mut self, key: &str) -> QueryResult<Vec<LockInfo>> {
        self.transaction(|c| force_release_in(c, key))
    }

    fn purge_stale_rows(&mut self) -> QueryResult<usize> {
        stmt("DELETE FROM dlock_rows WHERE stale_at <= now()").execute(self)
    }

    fn purge_mark_leases(&mut self, idle_us: i64) -> QueryResult<usize> {
        // A free row keeps the time of its last acquisition; an expired one its expiry.
        stmt(
            "WITH m AS ( \
               UPDATE dlock_leases SET holder = '', expires_at = now() + interval '1 minute' \
               WHERE (holder IS NULL AND acquired_at <= now() - ? * interval '1 microsecond') \
                  OR expires_at <= now() - ? * interval '1 microsecond' \
               RETURNING lock_key, token) \
             INSERT INTO dlock_tokens AS t (lock_key, token) SELECT lock_key, token FROM m \
             ON CONFLICT (lock_key) DO UPDATE SET token = GREATEST(t.token, EXCLUDED.token)",
        )
        .bind::<BigInt, _>(idle_us)
        .bind::<BigInt, _>(idle_us)
        .execute(self)
    }

    fn purge_delete_leases(&mut self) -> QueryResult<usize> {
        stmt(
            "DELETE FROM dlock_leases l USING dlock_tokens t \
             WHERE l.holder = '' AND t.lock_key = l.lock_key AND l.token <= t.token",
        )
        .execute(self)
    }

    fn sessions(&mut self) -> Option<&mut dyn SessionLocks> {
        Some(self)
    }
}

impl SessionLocks for PgConnection {
    fn is_lock_unavailable(&self, e: &diesel::result::Error) -> bool {
        lock_unavailable(e)
    }
    fn for_update_create(&mut self, key: &str) -> QueryResult<()> {
        stmt(
            "INSERT INTO dlock_for_update (lock_key, version) VALUES (?, 0) \
             ON CONFLICT (lock_key) DO NOTHING",
        )
        .bind::<Text, _>(key)
        .execute(self)
        .map(drop)
    }
    fn for_update_lock(&mut self, key: &str, wait: Wait) -> QueryResult<Option<Acquired>> {
        // One statement locks the row (the subquery's FOR UPDATE) and bumps its version,
        // which proves to for_update_held that this transaction still holds the row. The
        // token comes from a sequence, drawn in RETURNING (after the lock is ours): nextval
        // is not rolled back, so a dead holder's token is never reissued.
        // An INSERT ... ON CONFLICT here would wait for the holder whatever NOWAIT says:
        // the holder has updated the row, and the unique check waits for its transaction.
        // So the row is created apart (for_update_create) and only when it is missing.
        let q = match wait {
            Wait::No => stmt(
                "UPDATE dlock_for_update SET version = version + 1 WHERE lock_key = \
                 (SELECT lock_key FROM dlock_for_update WHERE lock_key = ? FOR UPDATE NOWAIT) \
                 RETURNING version AS id, nextval('dlock_fence_seq') AS token, clock_timestamp() AS acquired_at",
            )
            .bind::<Text, _>(key)
            .get_result::<AcquiredRow>(self),
            // set_config(.., true) is SET LOCAL: it ends with this transaction. It is
            // evaluated in the scan below the row lock, so it is in force before the wait.
            Wait::For(d) => stmt(
                "UPDATE dlock_for_update SET version = version + 1 WHERE lock_key = \
                 (SELECT lock_key FROM dlock_for_update WHERE lock_key = ? \
                  AND set_config('lock_timeout', ?, true) IS NOT NULL FOR UPDATE) \
                 RETURNING version AS id, nextval('dlock_fence_seq') AS token, clock_timestamp() AS acquired_at",
            )
            .bind::<Text, _>(key)
            .bind::<Text, _>(lock_timeout_ms(d))
            .get_result::<AcquiredRow>(self),
            Wait::Forever => stmt(
                "UPDATE dlock_for_update SET version = version + 1 WHERE lock_key = \
                 (SELECT lock_key FROM dlock_for_update WHERE lock_key = ? FOR UPDATE) \
                 RETURNING version AS id, nextval('dlock_fence_seq') AS token, clock_timestamp() AS acquired_at",
            )
            .bind::<Text, _>(key)
            .get_result::<AcquiredRow>(self),
        };
        q.optional().map(|r| r.map(Into::into))
    }
    fn for_update_held(&mut self, key: &str, version: i64) -> QueryResult<bool> {
        // Inside the holder's transaction this sees its own uncommitted version; a
        // transaction that ended (or a session that died) cannot answer yes.
        stmt("SELECT 1::int8 AS one FROM dlock_for_update WHERE lock_key = ? AND version = ?")
            .bind::<Text, _>(key)
            .bind::<BigInt, _>(version)
            .get_result::<One>(self)
            .optional()
            .map(|r| r.is_some())
    }
    fn advisory_lock(&mut self, key: &str, wait: Wait) -> QueryResult<Option<Acquired>> {
        // One statement takes the lock and then bumps the key's counter: the CTE holds a
        // volatile function, so PostgreSQL runs it once and before the INSERT reads it.
        // The counter is committed with the statement, so a token outlives its holder.
        let k = crate::key_hash(key);
        let taken = match wait {
            Wait::No => {
                return stmt(
                    "WITH l AS (SELECT pg_try_advisory_lock(?) AS got) \
                     INSERT INTO dlock_tokens AS t (lock_key, token) \
                     SELECT ?, 1 FROM l WHERE l.got \
                     ON CONFLICT (lock_key) DO UPDATE SET token = t.token + 1 \
                     RETURNING 0::int8 AS id, token, clock_timestamp() AS acquired_at",
                )
                .bind::<BigInt, _>(k)
                .bind::<Text, _>(key)
                .get_result::<AcquiredRow>(self)
                .optional()
                .map(|r| r.map(Into::into));
            }
            // set_config(.., true) lasts until the end of this statement's transaction.
            Wait::For(d) => stmt(
                "WITH l AS (SELECT CASE WHEN set_config('lock_timeout', ?, true) IS NOT NULL \
                                   THEN pg_advisory_lock(?) END AS got) \
                 INSERT INTO dlock_tokens AS t (lock_key, token) SELECT ?, 1 FROM l \
                 ON CONFLICT (lock_key) DO UPDATE SET token = t.token + 1 \
                 RETURNING 0::int8 AS id, token, clock_timestamp() AS acquired_at",
            )
            .bind::<Text, _>(lock_timeout_ms(d))
            .bind::<BigInt, _>(k)
            .bind::<Text, _>(key)
            .get_result::<AcquiredRow>(self),
            Wait::Forever => stmt(
                "WITH l AS (SELECT pg_advisory_lock(?) AS got) \
                 INSERT INTO dlock_tokens AS t (lock_key, token) SELECT ?, 1 FROM l \
                 ON CONFLICT (lock_key) DO UPDATE SET token = t.token + 1 \
                 RETURNING 0::int8 AS id, token, clock_timestamp() AS acquired_at",
            )
            .bind::<BigInt, _>(k)
            .bind::<Text, _>(key)
            .get_result::<AcquiredRow>(self),
        };
        match taken {
            Ok(row) => Ok(Some(row.into())),
            Err(e) if self.is_lock_unavailable(&e) => {
                // A lock granted just as lock_timeout fired stays granted to the session
                // even though the statement fails (LockErrorCleanup keeps it). So look, and
                // undo such a grant, unlocking only if pg_locks shows it held (an unlock of
                // a lock not held would log a WARNING).
                let (classid, objid) = advisory_lock_ids(key);
                let raced = stmt(
                    "SELECT pg_advisory_unlock(?) AS released FROM pg_locks \
                     WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted \
                       AND classid::int8 = ? AND objid::int8 = ? AND objsubid = 1",
                )
                .bind::<BigInt, _>(k)
                .bind::<BigInt, _>(classid)
                .bind::<BigInt, _>(objid)
                .get_result::<Released>(self)
                .optional()?;
                if raced.is_some_and(|r| r.released) {
                    log::debug!("lock {key:?}: a grant raced the wait's timeout; undone");
                }
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }
    fn advisory_unlock(&mut self, key: &str) -> QueryResult<bool> {
        stmt("SELECT pg_advisory_unlock(?) AS released")
            .bind::<BigInt, _>(crate::key_hash(key))
            .get_result::<Released>(self)
            .map(|r| r.released)
    }
    fn advisory_held(&mut self, key: &str) -> QueryResult<bool> {
        let (classid, objid) = advisory_lock_ids(key);
        stmt(
            "SELECT 1::int8 AS one FROM pg_locks \
             WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted \
               AND classid::int8 = ? AND objid::int8 = ? AND objsubid = 1",
        )
        .bind::<BigInt, _>(classid)
        .bind::<BigInt, _>(objid)
        .get_result::<One>(self)
        .optional()
        .map(|r| r.is_some())
    }
}

impl Sealed for PgConnection {
    fn dialect(&mut self, _: Seal) -> &mut dyn Dialect {
        self
    }

    fn static_backend(_: Seal) -> Option<Backend> {
        Some(Backend::Postgres)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use diesel::result::{DatabaseErrorKind, Error as E};

    fn db_error(message: &str) -> E {
        E::DatabaseError(DatabaseErrorKind::Unknown, Box::new(message.to_owned()))
    }

    /// The exact texts PostgreSQL 15 sends (English lc_messages); the integration tests in
    /// tests/session_faults.rs meet both against a real server.
    #[test]
    fn lock_unavailable_is_told_from_real_errors() {
        // 55P03 from NOWAIT and from lock_timeout: busy.
        for busy in [
            "could not obtain lock on row in relation \"dlock_for_update\"",
            "canceling statement due to lock timeout",
        ] {
            assert!(lock_unavailable(&db_error(busy)), "{busy}");
        }
        // A statement_timeout (57014), a deadlock (40P01, retried by the locker as
        // contention, but not "busy") and a lost connection are real errors here.
        for real in [
            "canceling statement due to statement timeout",
            "deadlock detected",
            "terminating connection due to administrator command",
            "relation \"dlock_for_update\" does not exist",
        ] {
            assert!(!lock_unavailable(&db_error(real)), "{real}");
        }
        assert!(!lock_unavailable(&E::NotFound));
    }

    #[test]
    fn advisory_ids_split_the_hash_as_pg_locks_shows_it() {
        // key_hash("x" * 65) = 0x9537c5fdf120482f, a negative i64: both halves unsigned.
        assert_eq!(advisory_lock_ids(&"x".repeat(65)), (0x9537c5fd, 0xf120482f));
        assert_eq!(lock_timeout_ms(std::time::Duration::from_micros(1)), "1");
        assert_eq!(lock_timeout_ms(std::time::Duration::from_micros(1001)), "2");
        assert_eq!(
            lock_timeout_ms(std::time::Duration::from_secs(30 * 24 * 3600)),
            "2147483647"
        );
    }
}
