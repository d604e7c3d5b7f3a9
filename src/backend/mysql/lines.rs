//! MySQL's statements of the line of waiters (`dlock_waiters`). No notifications here:
//! waiters poll their own place (`line_renew`, an update by primary key and an indexed count).

use crate::backend::sealed::{Joined, LineAhead, LineStat, Lines, Spot};
use crate::backend::shared::Mine;
use crate::backend::stmt::stmt;
use crate::backend::Line;
use diesel::mysql::MysqlConnection;
use diesel::sql_types::{BigInt, Integer, Nullable, Text};
use diesel::{QueryResult, QueryableByName, RunQueryDsl};

use super::LookRow;

/// A look at place `id` of a key's line (`Lines::line_look`), a consistent (non-locking)
/// read of the key's places up to it: binds the place four times, then the key, the line and
/// the place.
macro_rules! look {
    () => {
        "SELECT CAST(COALESCE(SUM(id = ? AND expires_at > UTC_TIMESTAMP(6)), 0) AS SIGNED) \
                  AS mine, \
                CAST(COALESCE(SUM(id < ? AND expires_at > UTC_TIMESTAMP(6) AND granted_at IS NULL), 0) AS SIGNED) \
                  AS ahead, \
                CAST(COALESCE(SUM(id < ? AND expires_at > UTC_TIMESTAMP(6) AND granted_at IS NULL AND shared = 0), 0) \
                  AS SIGNED) AS exclusive, \
                CAST(COALESCE(SUM(id = ? AND expires_at > UTC_TIMESTAMP(6) \
                                  AND granted_at IS NOT NULL), 0) AS SIGNED) AS granted, \
                CAST(NULL AS SIGNED) AS floor \
         FROM dlock_waiters WHERE lock_key = ? AND line = ? AND id <= ?"
    };
}

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

impl Lines for MysqlConnection {
    crate::backend::shared::statements!(line_leave);

    fn line_join(
        &mut self,
        key: &str,
        line: Line,
        owner: &str,
        channel: Option<&str>,
        ttl_us: i64,
        holder: &str,
        shared: bool,
        flag: bool,
    ) -> QueryResult<Joined> {
        // Lapsed places are left to `purge` (and ignored meanwhile): a DELETE by key here
        // would take next-key locks on the key's places and deadlock with other joiners.
        // Run again if it was a deadlock's victim: the INSERT writes the place's record,
        // then its entry in the key's index, where a locking read of the key's places (a
        // release with nobody in line, `nobody_in_line!`; a purge's checks) may hold the gap
        // while it waits for a record that a third statement keeps until it can read the new
        // one.
        crate::backoff::retry_contended(
            self,
            std::time::Duration::from_millis(16),
            "joining the line",
            |c| {
                stmt(
                    "INSERT INTO dlock_waiters \
                       (lock_key, line, owner, channel, since, expires_at, holder, shared) \
                     VALUES (?, ?, ?, ?, UTC_TIMESTAMP(6), \
                             UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, ?, ?)",
                )
                .bind::<Text, _>(key)
                .bind::<Integer, _>(line.id())
                .bind::<Text, _>(owner)
                .bind::<Nullable<Text>, _>(channel)
                .bind::<BigInt, _>(ttl_us)
                .bind::<Nullable<Text>, _>((!shared).then_some(holder))
                .bind::<Integer, _>(i32::from(shared))
                .execute(c)
            },
            super::deadlock_retryable,
        )?;
        let id = stmt("SELECT CAST(LAST_INSERT_ID() AS SIGNED) AS n")
            .get_result::<Count>(self)?
            .n;
        if flag {
            // A `Lease` key's row no longer says that nobody waits (`line_free`), once the
            // place is there: a release that would set it again reads the line with a
            // locking read, which sees the place (`handover.rs`). Between the two, a plain
            // release hands nothing over, and the waiter's first try, after this, finds the
            // key free.
            stmt("UPDATE dlock_leases SET line_free = 0 WHERE lock_key = ? AND line_free")
                .bind::<Text, _>(key)
                .execute(self)?;
        }
        Ok(Joined { id })
    }

    fn line_ahead(&mut self, key: &str, line: Line, place: i64) -> QueryResult<LineAhead> {
        // A consistent (non-locking) read: at READ COMMITTED (the holders' transaction) or
        // outside a transaction, the newest committed places.
        stmt(
            "SELECT CAST(COUNT(*) AS SIGNED) AS ahead, \
                    CAST(COALESCE(SUM(shared = 0), 0) AS SIGNED) AS exclusive \
             FROM dlock_waiters \
             WHERE lock_key = ? AND line = ? AND id < ? AND expires_at > UTC_TIMESTAMP(6) \
               AND granted_at IS NULL",
        )
        .bind::<Text, _>(key)
        .bind::<Integer, _>(line.id())
        .bind::<BigInt, _>(place)
        .get_result(self)
    }

    fn line_renew(
        &mut self,
        key: &str,
        line: Line,
        id: i64,
        ttl_us: i64,
        floor: i64,
    ) -> QueryResult<Option<Spot>> {
        // A granted place is not renewed (its expiry is its grant's deadline): the look
        // below then reports it granted. Run again if it was a deadlock's victim: a grant
        // (`handover.rs`) reads the place with a shared lock before it writes it, and a
        // renewal queued for the place's lock between the two deadlocks with it (built by
        // `a_renewal_picked_as_a_deadlock_victim_runs_again`; never met by the adversary).
        crate::backoff::retry_contended(
            self,
            std::time::Duration::from_millis(16),
            "renewing a place of the line",
            |c| {
                stmt(
                    "UPDATE dlock_waiters \
                     SET expires_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND \
                     WHERE id = ? AND expires_at > UTC_TIMESTAMP(6) AND granted_at IS NULL",
                )
                .bind::<BigInt, _>(ttl_us)
                .bind::<BigInt, _>(id)
                .execute(c)
            },
            super::deadlock_retryable,
        )?;
        self.line_look(key, line, id, floor)
    }

    fn line_look(
        &mut self,
        key: &str,
        line: Line,
        id: i64,
        _floor: i64,
    ) -> QueryResult<Option<Spot>> {
        stmt(look!())
            .bind::<BigInt, _>(id)
            .bind::<BigInt, _>(id)
            .bind::<BigInt, _>(id)
            .bind::<BigInt, _>(id)
            .bind::<Text, _>(key)
            .bind::<Integer, _>(line.id())
            .bind::<BigInt, _>(id)
            .get_result::<Mine>(self)
            .map(Mine::spot)
    }

    fn line_look_lease(
        &mut self,
        key: &str,
        id: i64,
        _floor: i64,
        holder: &str,
    ) -> QueryResult<Option<Spot>> {
        // One consistent read: the release that granted the place gave the lease in the
        // same transaction.
        stmt(concat!(
            "SELECT l.mine, l.ahead, l.exclusive, l.granted, l.floor, g.token, g.acquired_at \
             FROM (",
            look!(),
            ") l LEFT JOIN dlock_leases g \
               ON g.lock_key = ? AND g.holder_id = ? AND g.expires_at > UTC_TIMESTAMP(6)"
        ))
        .bind::<BigInt, _>(id)
        .bind::<BigInt, _>(id)
        .bind::<BigInt, _>(id)
        .bind::<BigInt, _>(id)
        .bind::<Text, _>(key)
        .bind::<Integer, _>(Line::Lease.id())
        .bind::<BigInt, _>(id)
        .bind::<Text, _>(key)
        .bind::<Text, _>(holder)
        .get_result::<LookRow>(self)
        .map(LookRow::spot)
    }

    fn line_stats(&mut self, key: Option<&str>) -> QueryResult<Vec<LineStat>> {
        stmt(
            "SELECT CAST(lock_key AS CHAR) AS lock_key, CAST(line AS SIGNED) AS line, CAST(COUNT(*) AS SIGNED) AS waiting, \
                    CAST(TIMESTAMPDIFF(MICROSECOND, MIN(since), UTC_TIMESTAMP(6)) AS SIGNED) \
                      AS longest_us \
             FROM dlock_waiters WHERE expires_at > UTC_TIMESTAMP(6) AND granted_at IS NULL \
               AND (? IS NULL OR lock_key = ?) \
             GROUP BY lock_key, line",
        )
        .bind::<Nullable<Text>, _>(key)
        .bind::<Nullable<Text>, _>(key)
        .load(self)
    }

    fn purge_lapsed_places(&mut self) -> QueryResult<usize> {
        // A scan of the whole table (no index on the expiry): under REPEATABLE READ it would
        // keep every place and gap it passed locked until its end, and hold up joiners,
        // renewals and releases of every key meanwhile; READ COMMITTED lets go of the places
        // that are not lapsed (as `purge_stale_rows`; for the next transaction only).
        stmt("SET TRANSACTION ISOLATION LEVEL READ COMMITTED").execute(self)?;
        stmt("DELETE FROM dlock_waiters WHERE expires_at <= UTC_TIMESTAMP(6)").execute(self)
    }
}

#[cfg(test)]
mod tests {
    //! A place's renewal and a joining waiter are run again when the server picks them as a
    //! deadlock's victim (CI of 26 Nov: `try_lock_for` failed with "Deadlock found" on
    //! MySQL beside a purge). Each test builds the deadlock on purpose, on a database of its
    //! own: a transaction that has written rows (so that the server rolls back the other
    //! statement, the lighter one) locks what the statement needs, waits until the
    //! statement waits for it, then asks for a lock the statement holds or is queued for.
    use super::*;
    use crate::backend::sealed::Dialect;
    use diesel::Connection;
    use std::time::{Duration, Instant};

    /// A database of the test's own, dropped at the end.
    struct OwnDb {
        admin: String,
        name: String,
    }

    impl Drop for OwnDb {
        fn drop(&mut self) {
            if let Ok(mut c) = MysqlConnection::establish(&self.admin) {
                let _ = stmt("SET SESSION lock_wait_timeout = 30").execute(&mut c);
                let _ = diesel::sql_query(format!("DROP DATABASE IF EXISTS {}", self.name))
                    .execute(&mut c);
            }
        }
    }

    /// Three connections to a new, migrated database; `None` where no MySQL server is
    /// configured (and none is required).
    fn connections(tag: &str) -> Option<(OwnDb, [MysqlConnection; 3])> {
        let admin = crate::test_env::server_url("DLOCK_TEST_MYSQL_URL", "mysql")?;
        let name = format!(
            "dlock_t_unit_{tag}_{}_{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        );
        diesel::sql_query(format!("CREATE DATABASE {name}"))
            .execute(&mut MysqlConnection::establish(&admin).unwrap())
            .unwrap();
        let db = OwnDb { admin, name };
        let (base, query) = match db.admin.split_once('?') {
            Some((b, q)) => (b, format!("?{q}")),
            None => (db.admin.as_str(), String::new()),
        };
        let url = format!("{}/{}{query}", &base[..base.rfind('/').unwrap()], db.name);
        let mut conns = [0, 1, 2].map(|_| MysqlConnection::establish(&url).unwrap());
        conns[0].run_migrations().unwrap();
        Some((db, conns))
    }

    fn join(c: &mut MysqlConnection, key: &str) -> i64 {
        c.line_join(
            key,
            Line::Row,
            "unit",
            None,
            60_000_000,
            &crate::random::holder_id(),
            false,
            false,
        )
        .unwrap()
        .id
    }

    fn connection_id(c: &mut MysqlConnection) -> i64 {
        stmt("SELECT CAST(CONNECTION_ID() AS SIGNED) AS n")
            .get_result::<Count>(c)
            .unwrap()
            .n
    }

    /// Waits (at most 20 s) until session `id` waits for a row lock.
    fn until_waiting(watch: &mut MysqlConnection, id: i64) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let n = stmt(
                "SELECT CAST(COUNT(*) AS SIGNED) AS n FROM information_schema.INNODB_TRX \
                 WHERE trx_mysql_thread_id = ? AND trx_state = 'LOCK WAIT'",
            )
            .bind::<BigInt, _>(id)
            .get_result::<Count>(watch)
            .unwrap()
            .n;
            if n == 1 {
                return;
            }
            assert!(Instant::now() < deadline, "session {id} never waited");
            // The server refreshes what INNODB_TRX shows only once nobody has read it for
            // 100 ms: a quicker poll, or two pollers side by side, would see the same answer
            // for ever. So one test at a time reads it (`POLLING`, and the nextest group
            // `innodb-trx` across processes: .config/nextest.toml).
            std::thread::sleep(Duration::from_millis(150));
        }
    }

    /// Opens a transaction on `c` that has written rows (places of another key): the
    /// server's deadlock resolution rolls back the lighter transaction, the other side.
    fn heavy_transaction(c: &mut MysqlConnection) {
        stmt("BEGIN").execute(c).unwrap();
        for _ in 0..50 {
            join(c, "unit-weight");
        }
    }

    /// One test of this process at a time polls INNODB_TRX (see `until_waiting`).
    static POLLING: std::sync::Mutex<()> = std::sync::Mutex::new(());

    /// A grant reads the place with a shared lock, then writes it; a renewal queued
    /// between the two for the place's lock is the deadlock's victim, and runs again.
    #[test]
    fn a_renewal_picked_as_a_deadlock_victim_runs_again() {
        let _one = POLLING
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some((_db, [mut a, mut b, mut watch])) = connections("renew") else {
            return;
        };
        let place = join(&mut b, "unit-renew");
        let b_id = connection_id(&mut b);
        heavy_transaction(&mut a);
        stmt("SELECT id AS n FROM dlock_waiters WHERE id = ? LOCK IN SHARE MODE")
            .bind::<BigInt, _>(place)
            .get_result::<Count>(&mut a)
            .unwrap();
        let renewal = std::thread::spawn(move || {
            let spot = b.line_renew("unit-renew", Line::Row, place, 60_000_000, 0);
            (b, spot)
        });
        until_waiting(&mut watch, b_id);
        stmt("UPDATE dlock_waiters SET since = since WHERE id = ?")
            .bind::<BigInt, _>(place)
            .execute(&mut a)
            .expect("the transaction with writes survives the deadlock");
        stmt("COMMIT").execute(&mut a).unwrap();
        let (_b, spot) = renewal.join().unwrap();
        let spot = spot.expect("the renewal is run again after the deadlock");
        assert!(spot.is_some_and(|s| s.ahead == 0 && !s.granted));
    }

    /// A locking read of the key's places holds the gap a new place's index entry goes
    /// into, then reads the new place's record: the INSERT, which wrote the record and
    /// waits for the gap, is the deadlock's victim, and runs again.
    #[test]
    fn a_join_picked_as_a_deadlock_victim_runs_again() {
        let _one = POLLING
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some((_db, [mut a, mut b, mut watch])) = connections("join") else {
            return;
        };
        let b_id = connection_id(&mut b);
        heavy_transaction(&mut a);
        let last = stmt("SELECT CAST(MAX(id) AS SIGNED) AS n FROM dlock_waiters")
            .get_result::<Count>(&mut a)
            .unwrap()
            .n;
        stmt(
            "SELECT CAST(COUNT(*) AS SIGNED) AS n FROM dlock_waiters \
             WHERE lock_key = 'unit-join' LOCK IN SHARE MODE",
        )
        .get_result::<Count>(&mut a)
        .unwrap();
        let joining = std::thread::spawn(move || {
            let place = b.line_join(
                "unit-join",
                Line::Row,
                "unit",
                None,
                60_000_000,
                &crate::random::holder_id(),
                false,
                false,
            );
            (b, place)
        });
        until_waiting(&mut watch, b_id);
        stmt(
            "SELECT CAST(COUNT(*) AS SIGNED) AS n FROM dlock_waiters FORCE INDEX (PRIMARY) \
             WHERE id > ? LOCK IN SHARE MODE",
        )
        .bind::<BigInt, _>(last)
        .get_result::<Count>(&mut a)
        .expect("the transaction with writes survives the deadlock");
        stmt("ROLLBACK").execute(&mut a).unwrap();
        let (mut b, place) = joining.join().unwrap();
        let place = place.expect("the join is run again after the deadlock").id;
        assert!(b
            .line_look("unit-join", Line::Row, place, 0)
            .unwrap()
            .is_some_and(|s| s.ahead == 0));
    }
}
