//! MySQL and MariaDB. Without `RETURNING` on MySQL, an acquisition that wins reads its token
//! back with a second statement; a failed one costs one statement.

use super::sealed::{Dialect, Seal, Sealed, SessionLocks};
use super::stmt::stmt;
use super::{force_release_in, migrate_with_retry, Acquired, Backend, Held, Wait};
use crate::admin::LockInfo;
use crate::{Error, Result};
use chrono::NaiveDateTime;
use diesel::mysql::MysqlConnection;
use diesel::sql_types::{BigInt, Datetime, Double, Nullable, Text};
use diesel::Connection;
use diesel::{OptionalExtension, QueryResult, QueryableByName, RunQueryDsl};
use diesel_migrations::{embed_migrations, EmbeddedMigrations, MigrationHarness};

const MIGRATIONS: EmbeddedMigrations = embed_migrations!("migrations/mysql");

#[derive(QueryableByName)]
struct AcquiredRow {
    #[diesel(sql_type = BigInt)]
    id: i64,
    #[diesel(sql_type = BigInt)]
    token: i64,
    #[diesel(sql_type = Datetime)]
    acquired_at: NaiveDateTime,
}

impl From<AcquiredRow> for Acquired {
    fn from(r: AcquiredRow) -> Self {
        Acquired {
            id: r.id,
            token: r.token,
            acquired_at: r.acquired_at.and_utc(),
        }
    }
}

#[derive(QueryableByName)]
struct Fence {
    #[diesel(sql_type = BigInt)]
    id: i64,
    #[diesel(sql_type = Datetime)]
    acquired_at: NaiveDateTime,
}

#[derive(QueryableByName)]
struct Id {
    #[diesel(sql_type = BigInt)]
    id: i64,
}

#[derive(QueryableByName)]
struct One {
    #[diesel(sql_type = BigInt)]
    one: i64,
}

#[derive(QueryableByName)]
struct Answer {
    #[diesel(sql_type = Nullable<BigInt>)]
    answer: Option<i64>,
}

/// The longest `GET_LOCK` name MySQL accepts (5.7 and later), in characters.
const MAX_LOCK_NAME_CHARS: usize = 64;

/// What marks a name as a hash; keys that start with it are hashed too, so a key used
/// verbatim can never equal another key's hashed name.
const HASHED_PREFIX: &str = "dlock-sha256:";

/// The `GET_LOCK` name of a key: the key itself when it has at most 64 characters, all of
/// them lowercase ASCII letters, digits or `.` `_` `:` `/` `-`, else `dlock-sha256:` and the 16
/// lowercase hex digits of [`key_hash`](crate::key_hash) (the first 8 bytes of SHA-256).
/// MySQL (unlike MariaDB) lowercases lock names and converts them to utf8mb3, which would make
/// `Report` and `report` one lock and refuse 4-byte characters; those keys are hashed, so keys
/// stay exact on both. Lock names are server-wide: the same key in two databases on one
/// server is one lock.
pub(crate) fn lock_name(key: &str) -> std::borrow::Cow<'_, str> {
    let plain = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || "._:/-".contains(c);
    if key.len() <= MAX_LOCK_NAME_CHARS && key.chars().all(plain) && !key.starts_with(HASHED_PREFIX)
    {
        key.into()
    } else {
        format!("{HASHED_PREFIX}{:016x}", crate::key_hash(key) as u64).into()
    }
}

/// A database error diesel has no kind for, with our own message.
fn error(message: &str) -> diesel::result::Error {
    diesel::result::Error::DatabaseError(
        diesel::result::DatabaseErrorKind::Unknown,
        Box::new(message.to_owned()),
    )
}

fn exists(q: QueryResult<Option<One>>) -> QueryResult<bool> {
    q.map(|r| r.is_some())
}

/// True if `e` says the lock is someone else's (see `Dialect::is_lock_unavailable`).
fn lock_unavailable(e: &diesel::result::Error) -> bool {
    // diesel maps neither error to a kind of its own (DatabaseErrorKind::Unknown) and
    // keeps no error number, so the server's English message is matched:
    // - MySQL 8, NOWAIT (3572, ER_LOCK_NOWAIT): "Statement aborted because lock(s)
    //   could not be acquired immediately and NOWAIT is set."
    // - MariaDB, NOWAIT, and both servers when innodb_lock_wait_timeout runs out (1205,
    //   ER_LOCK_WAIT_TIMEOUT): "Lock wait timeout exceeded; try restarting transaction"
    // MariaDB cannot tell its NOWAIT refusal from a real wait timeout, and need not:
    // either way the row is someone else's.
    match e {
        diesel::result::Error::DatabaseError(_, info) => {
            let m = info.message();
            m.starts_with("Lock wait timeout exceeded") || m.contains("NOWAIT is set")
        }
        _ => false,
    }
}

/// The longest `GET_LOCK` wait asked for (a year); the locker waits again after it.
const GET_LOCK_MAX_SECS: u64 = 31_536_000;

super::held_row!(Datetime, NaiveDateTime, |t| t.and_utc());

impl Dialect for MysqlConnection {
    super::same_sql_everywhere!();

    fn backend(&self) -> Backend {
        Backend::Mysql
    }

    fn run_migrations(&mut self) -> Result<()> {
        // GET_LOCK serialises concurrent migrate() calls from many processes.
        let got = stmt("SELECT CAST(GET_LOCK('diesel_lock.migrate', 60) AS SIGNED) AS one")
            .get_result::<One>(self)?;
        if got.one != 1 {
            return Err(Error::Migration(
                "another process held the migration lock for 60 s".into(),
            ));
        }
        let result = migrate_with_retry(self, |c| {
            c.run_pending_migrations(MIGRATIONS)
                .map(drop)
                .map_err(Error::Migration)
        });
        let unlocked = stmt("SELECT CAST(RELEASE_LOCK('diesel_lock.migrate') AS SIGNED) AS one")
            .get_result::<One>(self);
        result?;
        unlocked?;
        Ok(())
    }

    fn autocommits(&mut self) -> QueryResult<bool> {
        stmt("SELECT CAST(@@SESSION.autocommit AS SIGNED) AS one")
            .get_result::<One>(self)
            .map(|r| r.one == 1)
    }

    fn is_contention(&self, e: &diesel::result::Error) -> bool {
        use diesel::result::{DatabaseErrorKind, Error as E};
        match e {
            // 1213 (deadlock) is mapped to SerializationFailure by diesel.
            E::DatabaseError(DatabaseErrorKind::SerializationFailure, _) => true,
            // 1205 "Lock wait timeout exceeded" (also MariaDB's answer to NOWAIT) and 3572
            // (MySQL's NOWAIT) come through with their message only.
            E::DatabaseError(_, info) => {
                let m = info.message();
                m.starts_with("Lock wait timeout exceeded")
                    || m.contains("NOWAIT is set")
                    || m.starts_with("Deadlock found")
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
        retry: bool,
    ) -> QueryResult<Option<Acquired>> {
        // A waiter first looks with a consistent (non-locking) read: every failed INSERT
        // takes a shared lock on the holder's index record, and a crowd of them is what
        // makes InnoDB deadlock when the holder deletes the row.
        if retry
            && exists(
                stmt("SELECT CAST(1 AS SIGNED) AS one FROM dlock_rows WHERE lock_key = ?")
                    .bind::<Text, _>(key)
                    .get_result::<One>(self)
                    .optional(),
            )?
        {
            return Ok(None);
        }
        // The BEFORE INSERT trigger bumps the key's counter (locking its row until the
        // statement commits) and stamps the token, so tokens follow insertion order.
        let inserted = stmt(
            "INSERT IGNORE INTO dlock_rows (lock_key, owner, holder, token, acquired_at, stale_at) \
             VALUES (?, ?, ?, 0, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND)",
        )
        .bind::<Text, _>(key)
        .bind::<Text, _>(owner)
        .bind::<Text, _>(holder)
        .bind::<Nullable<BigInt>, _>(stale_us)
        .execute(self)?;
        if inserted != 1 {
            return Ok(None);
        }
        // Gone already means a stale takeover deleted it in between: not ours after all.
        stmt("SELECT id, token, acquired_at FROM dlock_rows WHERE id = LAST_INSERT_ID()")
            .get_result::<AcquiredRow>(self)
            .optional()
            .map(|r| r.map(Into::into))
    }

    fn row_forget(&mut self, key: &str, holder: &str) -> QueryResult<bool> {
        // Read, then delete by id, as row_delete_stale does, for the same lock order.
        let ours = stmt("SELECT id FROM dlock_rows WHERE lock_key = ? AND holder = ?")
            .bind::<Text, _>(key)
            .bind::<Text, _>(holder)
            .get_result::<Id>(self)
            .optional()?;
        let Some(Id { id }) = ours else {
            return Ok(false);
        };
        stmt("DELETE FROM dlock_rows WHERE id = ? AND holder = ?")
            .bind::<BigInt, _>(id)
            .bind::<Text, _>(holder)
            .execute(self)
            .map(|n| n > 0)
    }

    fn row_delete_stale(&mut self, key: &str) -> QueryResult<bool> {
        // Find the stale row with a consistent (non-locking) read, then delete it by id.
        // A DELETE by key would lock the unique index before the primary key, the opposite
        // order of a holder's DELETE by id, and the two deadlock.
        let stale =
            stmt("SELECT id FROM dlock_rows WHERE lock_key = ? AND stale_at <= UTC_TIMESTAMP(6)")
                .bind::<Text, _>(key)
                .get_result::<Id>(self)
                .optional()?;
        let Some(Id { id }) = stale else {
            return Ok(false);
        };
        stmt("DELETE FROM dlock_rows WHERE id = ? AND stale_at <= UTC_TIMESTAMP(6)")
            .bind::<BigInt, _>(id)
            .execute(self)
            .map(|n| n > 0)
    }

    fn row_release(&mut self, id: i64) -> QueryResult<bool> {
        stmt("DELETE FROM dlock_rows WHERE id = ?")
            .bind::<BigInt, _>(id)
            .execute(self)
            .map(|n| n == 1)
    }

    fn row_held(&mut self, id: i64) -> QueryResult<bool> {
        exists(
            stmt("SELECT CAST(1 AS SIGNED) AS one FROM dlock_rows WHERE id = ?")
                .bind::<BigInt, _>(id)
                .get_result::<One>(self)
                .optional(),
        )
    }

    fn lease_acquire(
        &mut self,
        key: &str,
        owner: &str,
        holder: &str,
        ttl_us: i64,
        retry: bool,
    ) -> QueryResult<Option<Acquired>> {
        if retry && lease_visibly_held(self, key)? {
            return Ok(None);
        }
        // MySQL applies ON DUPLICATE KEY UPDATE assignments left to right, each seeing the
        // ones before it, unless MariaDB's sql_mode SIMULTANEOUS_ASSIGNMENT is set, when
        // each sees the old row. Every condition reads only `expires_at`, which is assigned
        // last, so both orders decide alike. (A free lease has expires_at NULL: release
        // clears it together with the holder.)
        stmt(
            "INSERT INTO dlock_leases (lock_key, owner, holder, token, acquired_at, expires_at) \
             VALUES (?, ?, ?, COALESCE((SELECT token FROM dlock_tokens WHERE lock_key = ?), 0) + 1, \
                     UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND) \
             ON DUPLICATE KEY UPDATE \
               token = IF(expires_at IS NULL OR expires_at <= UTC_TIMESTAMP(6), \
                          token + 1, token), \
               owner = IF(expires_at IS NULL OR expires_at <= UTC_TIMESTAMP(6), \
                          VALUES(owner), owner), \
               holder = IF(expires_at IS NULL OR expires_at <= UTC_TIMESTAMP(6), \
                           VALUES(holder), holder), \
               acquired_at = IF(expires_at IS NULL OR expires_at <= UTC_TIMESTAMP(6), \
                                VALUES(acquired_at), acquired_at), \
               expires_at = IF(expires_at IS NULL OR expires_at <= UTC_TIMESTAMP(6), \
                               VALUES(expires_at), expires_at)",
        )
        .bind::<Text, _>(key)
        .bind::<Text, _>(owner)
        .bind::<Text, _>(holder)
        .bind::<Text, _>(key)
        .bind::<BigInt, _>(ttl_us)
        .execute(self)?;
        stmt(
            "SELECT CAST(0 AS SIGNED) AS id, token, acquired_at FROM dlock_leases \
             WHERE lock_key = ? AND holder = ?",
        )
        .bind::<Text, _>(key)
        .bind::<Text, _>(holder)
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
        // innodb_lock_wait_timeout counts whole seconds, 1 to 100,000,000. The session's own
        // setting is put back, as the connection goes back to the pool.
        let seconds = bound.as_secs() + u64::from(bound.subsec_nanos() > 0);
        stmt(
            "SET @dlock_saved_wait = @@SESSION.innodb_lock_wait_timeout, \
             SESSION innodb_lock_wait_timeout = ?",
        )
        .bind::<BigInt, _>(seconds.clamp(1, 100_000_000) as i64)
        .execute(self)?;
        // diesel sets CLIENT_FOUND_ROWS, so the count is of matched rows.
        let renewed = stmt(
            "UPDATE dlock_leases SET expires_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND \
             WHERE lock_key = ? AND holder = ? AND expires_at > UTC_TIMESTAMP(6)",
        )
        .bind::<BigInt, _>(ttl_us)
        .bind::<Text, _>(key)
        .bind::<Text, _>(holder)
        .execute(self)
        .map(|n| n == 1);
        stmt("SET SESSION innodb_lock_wait_timeout = @dlock_saved_wait").execute(self)?;
        renewed
    }

    fn lease_release(&mut self, key: &str, holder: &str) -> QueryResult<bool> {
        stmt(
            "UPDATE dlock_leases SET holder = NULL, expires_at = NULL \
             WHERE lock_key = ? AND holder = ?",
        )
        .bind::<Text, _>(key)
        .bind::<Text, _>(holder)
        .execute(self)
        .map(|n| n == 1)
    }

    fn lease_held(&mut self, key: &str, holder: &str) -> QueryResult<bool> {
        exists(
            stmt(
                "SELECT CAST(1 AS SIGNED) AS one FROM dlock_leases \
                 WHERE lock_key = ? AND holder = ? AND expires_at > UTC_TIMESTAMP(6)",
            )
            .bind::<Text, _>(key)
            .bind::<Text, _>(holder)
            .get_result::<One>(self)
            .optional(),
        )
    }

    fn version_create(&mut self, key: &str) -> QueryResult<()> {
        stmt("INSERT IGNORE INTO dlock_versions (lock_key, version) VALUES (?, 0)")
            .bind::<Text, _>(key)
            .execute(self)
            .map(drop)
    }

    // Keys are VARBINARY (byte-exact comparison); CAST(... AS CHAR) reads them back as text
    // in the connection's character set (utf8mb4, set by diesel). No FOR UPDATE here: a
    // locking read by key takes the unique index before the primary key, the opposite order
    // of a holder's DELETE by id, and the two can deadlock. force_release removes by row id
    // and holder id anyway, so it reports only what it really removed.
    fn admin_rows(&mut self, key: Option<&str>) -> QueryResult<Vec<Held>> {
        let rows = match key {
            None => stmt(
                "SELECT id, CAST(NULL AS CHAR) AS holder, CAST(lock_key AS CHAR) AS lock_key, \
                        owner, token, acquired_at, CAST(NULL AS DATETIME(6)) AS expires_at, \
                        UTC_TIMESTAMP(6) AS observed_at \
                 FROM dlock_rows ORDER BY lock_key",
            )
            .load(self),
            Some(key) => stmt(
                "SELECT id, CAST(NULL AS CHAR) AS holder, CAST(lock_key AS CHAR) AS lock_key, \
                        owner, token, acquired_at, CAST(NULL AS DATETIME(6)) AS expires_at, \
                        UTC_TIMESTAMP(6) AS observed_at \
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
                "SELECT CAST(0 AS SIGNED) AS id, holder, CAST(lock_key AS CHAR) AS lock_key, \
                        COALESCE(owner, '') AS owner, token, acquired_at, expires_at, \
                        UTC_TIMESTAMP(6) AS observed_at \
                 FROM dlock_leases \
                 WHERE holder IS NOT NULL AND holder <> '' AND acquired_at IS NOT NULL \
                   AND expires_at > UTC_TIMESTAMP(6) \
                 ORDER BY lock_key",
            )
            .load(self),
            Some(key) => stmt(
                "SELECT CAST(0 AS SIGNED) AS id, holder, CAST(lock_key AS CHAR) AS lock_key, \
                        COALESCE(owner, '') AS owner, token, acquired_at, expires_at, \
                        UTC_TIMESTAMP(6) AS observed_at \
                 FROM dlock_leases \
                 WHERE lock_key = ? AND holder IS NOT NULL AND holder <> '' AND acquired_at IS NOT NULL \
                   AND expires_at > UTC_TIMESTAMP(6)",
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
        // These statements scan whole tables. Under REPEATABLE READ InnoDB would keep every
        // scanned row locked until the end and block acquisitions meanwhile; READ COMMITTED
        // lets go of the rows that do not match. (Without GLOBAL or SESSION, SET TRANSACTION
        // applies to the next transaction only, so the pooled connection keeps its level.)
        stmt("SET TRANSACTION ISOLATION LEVEL READ COMMITTED").execute(self)?;
        stmt("DELETE FROM dlock_rows WHERE stale_at <= UTC_TIMESTAMP(6)").execute(self)
    }

    fn purge_mark_leases(&mut self, idle_us: i64) -> QueryResult<usize> {
        stmt("SET TRANSACTION ISOLATION LEVEL READ COMMITTED").execute(self)?;
        self.transaction(|c| {
            let marked = stmt(
                "UPDATE dlock_leases SET holder = '', expires_at = UTC_TIMESTAMP(6) + INTERVAL 1 MINUTE \
                 WHERE (holder IS NULL AND acquired_at <= UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND) \
                    OR expires_at <= UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND",
            )
            .bind::<BigInt, _>(idle_us)
            .bind::<BigInt, _>(idle_us)
            .execute(c)?;
            if marked > 0 {
                stmt(
                    "INSERT INTO dlock_tokens (lock_key, token) \
                     SELECT lock_key, token FROM dlock_leases WHERE holder = '' \
                     ON DUPLICATE KEY UPDATE token = GREATEST(dlock_tokens.token, VALUES(token))",
                )
                .execute(c)?;
            }
            Ok(marked)
        })
    }

    fn purge_delete_leases(&mut self) -> QueryResult<usize> {
        stmt("SET TRANSACTION ISOLATION LEVEL READ COMMITTED").execute(self)?;
        stmt(
            "DELETE l FROM dlock_leases l JOIN dlock_tokens t ON t.lock_key = l.lock_key \
             WHERE l.holder = '' AND l.token <= t.token",
        )
        .execute(self)
    }

    fn sessions(&mut self) -> Option<&mut dyn SessionLocks> {
        Some(self)
    }
}

impl SessionLocks for MysqlConnection {
    fn is_lock_unavailable(&self, e: &diesel::result::Error) -> bool {
        lock_unavailable(e)
    }
    fn for_update_create(&mut self, key: &str) -> QueryResult<()> {
        stmt("INSERT IGNORE INTO dlock_for_update (lock_key, version) VALUES (?, 0)")
            .bind::<Text, _>(key)
            .execute(self)
            .map(drop)
    }
    fn for_update_lock(&mut self, key: &str, wait: Wait) -> QueryResult<Option<Acquired>> {
        // innodb_lock_wait_timeout counts whole seconds (and MariaDB's `WAIT n` rounds a
        // fraction down to 0), so a bounded wait waits the whole seconds it has server-side
        // and leaves the rest to the locker's NOWAIT retries, never overshooting.
        // At most 100,000,000 s, the largest the server takes; a longer wait ends there as
        // busy and the locker waits again until its deadline.
        let seconds = match wait {
            Wait::For(d) => d.as_secs().min(100_000_000),
            _ => 0,
        };
        let locked = match wait {
            Wait::Forever => stmt(
                "SELECT CAST(1 AS SIGNED) AS one FROM dlock_for_update \
                 WHERE lock_key = ? FOR UPDATE",
            )
            .bind::<Text, _>(key)
            .get_result::<One>(self)
            .optional(),
            Wait::For(_) if seconds > 0 => {
                // The session's own setting is saved and put back, as the connection goes
                // back to the pool and on to other users.
                stmt(
                    "SET @dlock_saved_wait = @@SESSION.innodb_lock_wait_timeout, \
                     SESSION innodb_lock_wait_timeout = ?",
                )
                .bind::<BigInt, _>(i64::try_from(seconds).unwrap_or(i64::MAX))
                .execute(self)?;
                let locked = stmt(
                    "SELECT CAST(1 AS SIGNED) AS one FROM dlock_for_update \
                     WHERE lock_key = ? FOR UPDATE",
                )
                .bind::<Text, _>(key)
                .get_result::<One>(self)
                .optional();
                stmt("SET SESSION innodb_lock_wait_timeout = @dlock_saved_wait").execute(self)?;
                locked
            }
            _ => stmt(
                "SELECT CAST(1 AS SIGNED) AS one FROM dlock_for_update \
                 WHERE lock_key = ? FOR UPDATE NOWAIT",
            )
            .bind::<Text, _>(key)
            .get_result::<One>(self)
            .optional(),
        }?;
        if locked.is_none() {
            return Ok(None);
        }
        // The token is an AUTO_INCREMENT id drawn now that the row is ours: a rollback
        // does not give an id back, so a dead holder's token is never reissued. The row
        // itself stays uncommitted, visible only to this transaction, until
        // for_update_finish deletes it: it is the proof for for_update_held.
        stmt("INSERT INTO dlock_fences (lock_key) VALUES (?)")
            .bind::<Text, _>(key)
            .execute(self)?;
        // The time is read here, once the lock is ours: the locking statement's own clock
        // stopped when it began, before any wait.
        let fence = stmt(
            "SELECT id, UTC_TIMESTAMP(6) AS acquired_at FROM dlock_fences \
             WHERE id = LAST_INSERT_ID()",
        )
        .get_result::<Fence>(self)?;
        Ok(Some(Acquired {
            id: fence.id,
            token: fence.id,
            acquired_at: fence.acquired_at.and_utc(),
        }))
    }
    fn for_update_held(&mut self, _key: &str, fence: i64) -> QueryResult<bool> {
        // Only the holder's own open transaction can see its uncommitted fence row.
        exists(
            stmt("SELECT CAST(1 AS SIGNED) AS one FROM dlock_fences WHERE id = ?")
                .bind::<BigInt, _>(fence)
                .get_result::<One>(self)
                .optional(),
        )
    }
    fn for_update_finish(&mut self, fence: i64) -> QueryResult<bool> {
        stmt("DELETE FROM dlock_fences WHERE id = ?")
            .bind::<BigInt, _>(fence)
            .execute(self)
            .map(|n| n == 1)
    }
    fn advisory_lock(&mut self, key: &str, wait: Wait) -> QueryResult<Option<Acquired>> {
        let name = lock_name(key);
        let got = match wait {
            Wait::No => stmt("SELECT CAST(GET_LOCK(?, 0) AS SIGNED) AS answer")
                .bind::<Text, _>(&*name)
                .get_result::<Answer>(self),
            // MySQL reads a negative timeout as "forever", MariaDB refuses it (NULL and
            // warning 1411); a year is accepted by both and ends as an ordinary timeout.
            // (MariaDB answers a much longer one, 10^12 s, with 0 at once.)
            Wait::Forever => stmt("SELECT CAST(GET_LOCK(?, 31536000) AS SIGNED) AS answer")
                .bind::<Text, _>(&*name)
                .get_result::<Answer>(self),
            Wait::For(d) if d.as_secs() >= GET_LOCK_MAX_SECS => {
                stmt("SELECT CAST(GET_LOCK(?, 31536000) AS SIGNED) AS answer")
                    .bind::<Text, _>(&*name)
                    .get_result::<Answer>(self)
            }
            // MariaDB honours fractions of a second; MySQL may round the timeout to whole
            // seconds, up as well as down, so it is given only the whole seconds.
            Wait::For(d) => stmt(
                "SELECT CAST(GET_LOCK(?, IF(VERSION() LIKE '%MariaDB%', ?, FLOOR(?))) \
                 AS SIGNED) AS answer",
            )
            .bind::<Text, _>(&*name)
            .bind::<Double, _>(d.as_secs_f64())
            .bind::<Double, _>(d.as_secs_f64())
            .get_result::<Answer>(self),
        }?;
        match got.answer {
            Some(1) => {}
            Some(_) => {
                // 0 is a timeout. GET_LOCK decides atomically, but a lock that this session
                // holds must not stay behind whatever it said, so make sure.
                if self.advisory_held(key)? {
                    log::warn!("lock {key:?}: GET_LOCK timed out yet the lock is ours; releasing");
                    self.advisory_unlock(key)?;
                }
                return Ok(None);
            }
            None => return Err(error("GET_LOCK failed (returned NULL)")),
        }
        // The counter is bumped only once the lock is held, and committed at once
        // (autocommit), so a token outlives its holder. LAST_INSERT_ID(expr) hands the new
        // value back to this session without a race, on both the insert and update paths.
        stmt(
            "INSERT INTO dlock_tokens (lock_key, token) VALUES (?, LAST_INSERT_ID(1)) \
             ON DUPLICATE KEY UPDATE token = LAST_INSERT_ID(token + 1)",
        )
        .bind::<Text, _>(key)
        .execute(self)?;
        stmt(
            "SELECT CAST(0 AS SIGNED) AS id, CAST(LAST_INSERT_ID() AS SIGNED) AS token, \
             UTC_TIMESTAMP(6) AS acquired_at",
        )
        .get_result::<AcquiredRow>(self)
        .map(|r| Some(r.into()))
    }
    fn advisory_unlock(&mut self, key: &str) -> QueryResult<bool> {
        // 1: released; 0: held by another session; NULL: not held by anyone.
        stmt("SELECT CAST(RELEASE_LOCK(?) AS SIGNED) AS answer")
            .bind::<Text, _>(&*lock_name(key))
            .get_result::<Answer>(self)
            .map(|r| r.answer == Some(1))
    }
    fn advisory_held(&mut self, key: &str) -> QueryResult<bool> {
        stmt("SELECT CAST(IS_USED_LOCK(?) = CONNECTION_ID() AS SIGNED) AS answer")
            .bind::<Text, _>(&*lock_name(key))
            .get_result::<Answer>(self)
            .map(|r| r.answer == Some(1))
    }
}

impl Sealed for MysqlConnection {
    fn dialect(&mut self, _: Seal) -> &mut dyn Dialect {
        self
    }

    fn static_backend(_: Seal) -> Option<Backend> {
        Some(Backend::Mysql)
    }
}

/// A plain consistent read: is the lease held and unexpired right now?
fn lease_visibly_held(conn: &mut MysqlConnection, key: &str) -> QueryResult<bool> {
    exists(
        stmt(
            "SELECT CAST(1 AS SIGNED) AS one FROM dlock_leases WHERE lock_key = ? \
             AND holder IS NOT NULL AND expires_at > UTC_TIMESTAMP(6)",
        )
        .bind::<Text, _>(key)
        .get_result::<One>(conn)
        .optional(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use diesel::result::{DatabaseErrorKind, Error as E};

    fn db_error(message: &str) -> E {
        E::DatabaseError(DatabaseErrorKind::Unknown, Box::new(message.to_owned()))
    }

    /// The exact texts of MySQL 8 (3572) and of MariaDB / MySQL (1205). Only MariaDB runs
    /// here, so the 3572 path is tested by its text alone; tests/session_faults.rs meets
    /// 1205 from both NOWAIT and innodb_lock_wait_timeout against the real server.
    #[test]
    fn lock_unavailable_is_told_from_real_errors() {
        for busy in [
            "Statement aborted because lock(s) could not be acquired immediately and NOWAIT is set.",
            "Lock wait timeout exceeded; try restarting transaction",
        ] {
            assert!(lock_unavailable(&db_error(busy)), "{busy}");
        }
        for real in [
            "Deadlock found when trying to get lock; try restarting transaction",
            "Lost connection to MySQL server during query",
            "MySQL server has gone away",
            "Query execution was interrupted",
            "Table 'dlock_test.dlock_for_update' doesn't exist",
        ] {
            assert!(!lock_unavailable(&db_error(real)), "{real}");
        }
    }

    #[test]
    fn lock_names_are_verbatim_up_to_64_characters_then_hashed() {
        assert_eq!(lock_name("nightly-report"), "nightly-report");
        let x64 = "x".repeat(64);
        assert_eq!(lock_name(&x64), x64.as_str());
        // Upper case, spaces and non-ASCII are hashed: MySQL folds case and charset.
        assert_eq!(lock_name("Nightly-Report"), "dlock-sha256:3869aaf865c191f5");
        assert_eq!(lock_name("ключ-🔒"), "dlock-sha256:01ee05df8e3fd0cb");
        // Test vector: sha256("x" × 65) starts 9537c5fdf120482f.
        assert_eq!(lock_name(&"x".repeat(65)), "dlock-sha256:9537c5fdf120482f");
        // A key that looks like a hashed name is hashed too, so it cannot collide with one.
        let lookalike = "dlock-sha256:9537c5fdf120482f";
        assert_ne!(lock_name(lookalike), lookalike);
        assert!(lock_name(lookalike).starts_with(HASHED_PREFIX));
    }
}
