//! MySQL and MariaDB. Without `RETURNING` on MySQL, an acquisition that wins reads its token
//! back with a second statement; a failed one costs one statement.

use super::sealed::Dialect;
use super::stmt::stmt;
use super::{migrate_with_retry, Acquired, Backend};
use crate::{Error, Result};
use chrono::NaiveDateTime;
use diesel::mysql::MysqlConnection;
use diesel::sql_types::{BigInt, Datetime, Text};
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
struct Id {
    #[diesel(sql_type = BigInt)]
    id: i64,
}

#[derive(QueryableByName)]
struct One {
    #[diesel(sql_type = BigInt)]
    one: i64,
}

fn exists(q: QueryResult<Option<One>>) -> QueryResult<bool> {
    q.map(|r| r.is_some())
}

impl Dialect for MysqlConnection {
    fn backend(&self) -> Backend {
        Backend::Mysql
    }

    fn static_backend() -> Option<Backend> {
        Some(Backend::Mysql)
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
            "INSERT IGNORE INTO dlock_rows (lock_key, owner, token, acquired_at) \
             VALUES (?, ?, 0, UTC_TIMESTAMP(6))",
        )
        .bind::<Text, _>(key)
        .bind::<Text, _>(owner)
        .execute(self)?;
        if inserted != 1 {
            return Ok(None);
        }
        stmt("SELECT id, token, acquired_at FROM dlock_rows WHERE id = LAST_INSERT_ID()")
            .get_result::<AcquiredRow>(self)
            .map(|r| Some(r.into()))
    }

    fn row_delete_stale(&mut self, key: &str, stale_us: i64) -> QueryResult<bool> {
        // Find the stale row with a consistent (non-locking) read, then delete it by id.
        // A DELETE by key would lock the unique index before the primary key, the opposite
        // order of a holder's DELETE by id, and the two deadlock.
        let stale = stmt(
            "SELECT id FROM dlock_rows WHERE lock_key = ? \
             AND acquired_at <= UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND",
        )
        .bind::<Text, _>(key)
        .bind::<BigInt, _>(stale_us)
        .get_result::<Id>(self)
        .optional()?;
        let Some(Id { id }) = stale else {
            return Ok(false);
        };
        stmt(
            "DELETE FROM dlock_rows WHERE id = ? \
             AND acquired_at <= UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND",
        )
        .bind::<BigInt, _>(id)
        .bind::<BigInt, _>(stale_us)
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
        // ones before it. So `holder` is decided first, from the old row, and every other
        // column follows it: holder ids are unique per acquisition, so `holder = ours`
        // after the first assignment means "we just took it".
        stmt(
            "INSERT INTO dlock_leases (lock_key, owner, holder, token, acquired_at, expires_at) \
             VALUES (?, ?, ?, 1, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND) \
             ON DUPLICATE KEY UPDATE \
               holder = IF(holder IS NULL OR expires_at <= UTC_TIMESTAMP(6), \
                           VALUES(holder), holder), \
               token = IF(holder <=> VALUES(holder), token + 1, token), \
               owner = IF(holder <=> VALUES(holder), VALUES(owner), owner), \
               acquired_at = IF(holder <=> VALUES(holder), VALUES(acquired_at), acquired_at), \
               expires_at = IF(holder <=> VALUES(holder), VALUES(expires_at), expires_at)",
        )
        .bind::<Text, _>(key)
        .bind::<Text, _>(owner)
        .bind::<Text, _>(holder)
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

    fn lease_renew(&mut self, key: &str, holder: &str, ttl_us: i64) -> QueryResult<bool> {
        // diesel sets CLIENT_FOUND_ROWS, so the count is of matched rows.
        stmt(
            "UPDATE dlock_leases SET expires_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND \
             WHERE lock_key = ? AND holder = ? AND expires_at > UTC_TIMESTAMP(6)",
        )
        .bind::<BigInt, _>(ttl_us)
        .bind::<Text, _>(key)
        .bind::<Text, _>(holder)
        .execute(self)
        .map(|n| n == 1)
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
