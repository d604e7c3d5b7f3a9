//! SQLite's statements of shared leases and semaphore permits (see `backend/holders.rs`).
//! The acquisition's transaction is IMMEDIATE: it takes the single write lock first, so
//! nothing it reads can change before it commits.

use super::{seconds, AcquiredRow};
use crate::backend::holders::HolderSteps;
use crate::backend::holders::{self, Header, HolderAnswer, HolderAsk, HolderLocks, HolderRow};
use crate::backend::shared::{exists, KeyHolder, One};
use crate::backend::stmt::{in_list, pad, stmt, BATCH_SIZES};
use crate::backend::Acquired;
use chrono::NaiveDateTime;
use diesel::sql_types::{BigInt, Nullable, Text, Timestamp};
use diesel::sqlite::SqliteConnection;
use diesel::{OptionalExtension, QueryResult, QueryableByName, RunQueryDsl};
use std::sync::OnceLock;

holders::holder_row!(Timestamp, NaiveDateTime, |t| t.and_utc());

/// A live place's doorbell (`doorbell.rs`), which a release of a reader or permit rings.
#[derive(QueryableByName)]
struct Bell {
    #[diesel(sql_type = Nullable<Text>)]
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))]
    channel: Option<String>,
}

/// How many of the first live places a release of a reader or permit rings: more than any
/// one release can let in, short of a long line's whole length.
const RING_FIRST: i64 = 16;

#[derive(QueryableByName)]
struct Counts {
    #[diesel(sql_type = BigInt)]
    total: i64,
    #[diesel(sql_type = BigInt)]
    writers: i64,
}

impl HolderSteps for SqliteConnection {
    crate::backend::shared::statements!(create_header);

    fn create_lease(&mut self, key: &str) -> QueryResult<()> {
        stmt(
            "INSERT INTO dlock_leases (lock_key, token, acquired_at) \
             SELECT ?, max(COALESCE((SELECT token FROM dlock_tokens WHERE lock_key = ?), 0), \
                           COALESCE((SELECT floor_token FROM dlock_token_floor \
                                     WHERE bucket = ?), 0)), \
                    strftime('%Y-%m-%d %H:%M:%f', 'now') \
             WHERE true ON CONFLICT (lock_key) DO NOTHING",
        )
        .bind::<Text, _>(key)
        .bind::<Text, _>(key)
        .bind::<BigInt, _>(crate::key::floor_bucket(key))
        .execute(self)
        .map(drop)
    }

    fn lock_lease(&mut self, key: &str) -> QueryResult<Option<bool>> {
        // The transaction holds the write lock already: reading is enough.
        stmt(
            "SELECT COALESCE(holder_id IS NOT NULL \
                             AND expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now'), 0) AS one \
             FROM dlock_leases WHERE lock_key = ?",
        )
        .bind::<Text, _>(key)
        .get_result::<One>(self)
        .optional()
        .map(|r| r.map(|r| r.one == 1))
    }

    fn lock_header(&mut self, key: &str) -> QueryResult<Option<Header>> {
        stmt("SELECT permit_count AS one FROM dlock_shared_keys WHERE lock_key = ?")
            .bind::<Text, _>(key)
            .get_result::<One>(self)
            .optional()
            .map(|r| r.map(|r| Header { permits: r.one }))
    }

    fn expire(&mut self, key: &str) -> QueryResult<()> {
        stmt(
            "DELETE FROM dlock_shared_leases \
             WHERE lock_key = ? AND expires_at <= strftime('%Y-%m-%d %H:%M:%f', 'now')",
        )
        .bind::<Text, _>(key)
        .execute(self)
        .map(drop)
    }

    fn count(&mut self, key: &str) -> QueryResult<(i64, i64)> {
        stmt(
            "SELECT count(*) AS total, COALESCE(sum(mode = 'write'), 0) AS writers \
             FROM dlock_shared_leases WHERE lock_key = ?",
        )
        .bind::<Text, _>(key)
        .get_result::<Counts>(self)
        .map(|c| (c.total, c.writers))
    }

    fn insert(&mut self, ask: &HolderAsk<'_>) -> QueryResult<Acquired> {
        // The holder row takes the key's next token from the lease row, then the lease row
        // takes that token and the holder's expiry (one instant, written once, so that
        // `shared_until` is never short of it).
        let acquired = stmt(
            "INSERT INTO dlock_shared_leases \
                    (lock_key, holder_id, owner, mode, token, acquired_at, expires_at) \
             SELECT ?, ?, ?, ?, token + 1, strftime('%Y-%m-%d %H:%M:%f', 'now'), \
                    strftime('%Y-%m-%d %H:%M:%f', 'now', ?) \
             FROM dlock_leases WHERE lock_key = ? \
             RETURNING 0 AS id, token, acquired_at",
        )
        .bind::<Text, _>(ask.key)
        .bind::<Text, _>(ask.holder)
        .bind::<Text, _>(ask.owner)
        .bind::<Text, _>(ask.mode.as_str())
        .bind::<Text, _>(seconds('+', ask.ttl_us))
        .bind::<Text, _>(ask.key)
        .get_result::<AcquiredRow>(self)?;
        stmt(
            "UPDATE dlock_leases SET token = s.token, \
                    shared_until = max(COALESCE(dlock_leases.shared_until, ''), s.expires_at) \
             FROM (SELECT token, expires_at FROM dlock_shared_leases \
                   WHERE lock_key = ? AND holder_id = ?) AS s \
             WHERE dlock_leases.lock_key = ?",
        )
        .bind::<Text, _>(ask.key)
        .bind::<Text, _>(ask.holder)
        .bind::<Text, _>(ask.key)
        .execute(self)?;
        Ok(acquired.into())
    }
}

impl HolderLocks for SqliteConnection {
    fn holders_purge(&mut self, idle_us: i64) -> QueryResult<usize> {
        stmt(
            "DELETE FROM dlock_shared_leases \
             WHERE expires_at <= strftime('%Y-%m-%d %H:%M:%f', 'now', ?)",
        )
        .bind::<Text, _>(seconds('-', idle_us))
        .execute(self)
    }

    fn holders_acquire(&mut self, ask: &HolderAsk<'_>) -> QueryResult<HolderAnswer> {
        holders::acquire_with(self, ask, |c, ask| {
            c.immediate_transaction(|c| holders::decide(c, ask))
        })
    }

    fn holders_renew(
        &mut self,
        key: &str,
        holder: &str,
        ttl_us: i64,
        _bound: std::time::Duration,
    ) -> QueryResult<bool> {
        // The holder row, then the lease row raised to the holder's new expiry, under the
        // one write lock. Without its lease row the holder no longer keeps the exclusive
        // lock out: lost (the holder row's extension is rolled back).
        let renewed = self.immediate_transaction(|c| {
            let renewed = stmt(
                "UPDATE dlock_shared_leases \
                 SET expires_at = strftime('%Y-%m-%d %H:%M:%f', 'now', ?) \
                 WHERE lock_key = ? AND holder_id = ? \
                   AND expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now')",
            )
            .bind::<Text, _>(seconds('+', ttl_us))
            .bind::<Text, _>(key)
            .bind::<Text, _>(holder)
            .execute(c)?
                == 1;
            if renewed {
                let lease = stmt(
                    "UPDATE dlock_leases SET shared_until = max(COALESCE(shared_until, ''), \
                        (SELECT expires_at FROM dlock_shared_leases \
                         WHERE lock_key = ? AND holder_id = ?)) \
                     WHERE lock_key = ?",
                )
                .bind::<Text, _>(key)
                .bind::<Text, _>(holder)
                .bind::<Text, _>(key)
                .execute(c)?;
                if lease == 0 {
                    return Err(diesel::result::Error::RollbackTransaction);
                }
            }
            Ok(renewed)
        });
        match renewed {
            Err(diesel::result::Error::RollbackTransaction) => Ok(false),
            r => r,
        }
    }

    fn holders_renew_many(
        &mut self,
        holders: &[(String, String)],
        ttl_us: i64,
    ) -> QueryResult<Vec<String>> {
        static RENEW: [OnceLock<String>; BATCH_SIZES.len()] =
            [const { OnceLock::new() }; BATCH_SIZES.len()];
        static RAISE: [OnceLock<String>; BATCH_SIZES.len()] =
            [const { OnceLock::new() }; BATCH_SIZES.len()];
        // As `holders_renew`, for many, under the one write lock: the live holder rows whose
        // key still has its lease row, then those keys' `shared_until` raised to their
        // latest holder's expiry (the rows just renewed; any other live holder's expiry is
        // already below it). Holder ids are 128 random bits: the pair of lists matches
        // exactly our holders. `+holder_id`: the index is searched by key alone, the holder
        // ids only filter (else SQLite searches every key with every holder id, 500 × 500
        // probes for a full batch).
        let (keys, ids): (Vec<String>, Vec<String>) = pad(holders.to_vec()).into_iter().unzip();
        self.immediate_transaction(|c| {
            let renew = in_list(
                &RENEW,
                "UPDATE dlock_shared_leases \
                 SET expires_at = strftime('%Y-%m-%d %H:%M:%f', 'now', ?) \
                 WHERE lock_key IN ({}) AND +holder_id IN ({}) \
                   AND expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now') \
                   AND EXISTS (SELECT 1 FROM dlock_leases l \
                               WHERE l.lock_key = dlock_shared_leases.lock_key) \
                 RETURNING lock_key, holder_id",
                keys.len(),
            );
            let rows = stmt(renew)
                .bind::<Text, _>(seconds('+', ttl_us))
                .bind_many::<Text, _>(keys)
                .bind_many::<Text, _>(ids)
                .load::<KeyHolder>(c)?;
            if rows.is_empty() {
                return Ok(Vec::new());
            }
            let mut keys: Vec<String> = rows.iter().map(|r| r.lock_key.clone()).collect();
            keys.sort_unstable();
            keys.dedup();
            let keys = pad(keys);
            let raise = in_list(
                &RAISE,
                "UPDATE dlock_leases SET shared_until = max(COALESCE(shared_until, ''), \
                    (SELECT max(s.expires_at) FROM dlock_shared_leases s \
                     WHERE s.lock_key = dlock_leases.lock_key)) \
                 WHERE lock_key IN ({})",
                keys.len(),
            );
            stmt(raise).bind_many::<Text, _>(keys).execute(c)?;
            Ok(rows.into_iter().map(|r| r.holder_id).collect())
        })
    }

    fn holders_release(&mut self, key: &str, holder: &str) -> QueryResult<bool> {
        // Under the one write lock: the holder row goes, and `shared_until` comes down to
        // the latest expiry of the key's other live holders.
        // The first live places' doorbells are rung once committed (a semaphore's waiters,
        // readers behind this one's writer, the writer that waited for the last reader):
        // each then looks and tries at once instead of at its fallback pace.
        let (gone, bells) = self.immediate_transaction(|c| -> QueryResult<(bool, Vec<Bell>)> {
            let gone = stmt("DELETE FROM dlock_shared_leases WHERE lock_key = ? AND holder_id = ?")
                .bind::<Text, _>(key)
                .bind::<Text, _>(holder)
                .execute(c)?
                == 1;
            if !gone {
                return Ok((false, Vec::new()));
            }
            stmt(
                "UPDATE dlock_leases SET shared_until = \
                   (SELECT max(expires_at) FROM dlock_shared_leases \
                    WHERE lock_key = ? AND expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now')) \
                 WHERE lock_key = ?",
            )
            .bind::<Text, _>(key)
            .bind::<Text, _>(key)
            .execute(c)?;
            let bells = stmt(concat!(
                "SELECT channel FROM dlock_waiters \
                 WHERE lock_key = ? AND line = ",
                line_sql!(lease),
                " \
                   AND expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now') \
                   AND granted_at IS NULL AND channel IS NOT NULL \
                 ORDER BY id LIMIT ?",
            ))
            .bind::<Text, _>(key)
            .bind::<BigInt, _>(RING_FIRST)
            .load::<Bell>(c)?;
            Ok((true, bells))
        })?;
        #[cfg(target_os = "linux")]
        {
            let mut rung: Vec<&str> = Vec::new();
            for b in &bells {
                if let Some(ch) = b.channel.as_deref() {
                    if !rung.contains(&ch) {
                        super::doorbell::ring(Some(ch), key);
                        rung.push(ch);
                    }
                }
            }
        }
        #[cfg(not(target_os = "linux"))]
        drop(bells);
        Ok(gone)
    }

    fn holders_held(&mut self, key: &str, holder: &str) -> QueryResult<bool> {
        exists(
            stmt(
                "SELECT 1 AS one FROM dlock_shared_leases \
                 WHERE lock_key = ? AND holder_id = ? \
                   AND expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now')",
            )
            .bind::<Text, _>(key)
            .bind::<Text, _>(holder)
            .get_result::<One>(self)
            .optional(),
        )
    }

    fn admin_holders(&mut self, key: Option<&str>) -> QueryResult<Vec<HolderRow>> {
        let rows = stmt(
            "SELECT l.lock_key, l.holder_id AS holder, l.owner, l.mode, k.permit_count AS permits, l.token, \
                    l.acquired_at, l.expires_at, \
                    strftime('%Y-%m-%d %H:%M:%f', 'now') AS observed_at \
             FROM dlock_shared_leases l JOIN dlock_shared_keys k ON k.lock_key = l.lock_key \
             WHERE l.expires_at > strftime('%Y-%m-%d %H:%M:%f', 'now') \
               AND (? IS NULL OR l.lock_key = ?) \
             ORDER BY l.lock_key, l.token",
        )
        .bind::<Nullable<Text>, _>(key)
        .bind::<Nullable<Text>, _>(key)
        .load(self);
        holder_rows(rows)
    }
}
