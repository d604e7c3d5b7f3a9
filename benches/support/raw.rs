//! Each strategy × backend's cycle through the library beside its raw floor: the library's
//! own SQL statements (copied from src/backend/*.rs), issued in the same order on a
//! connection from the same pool, with no library code around them.

use super::{sql, Db, TTL};
use diesel::r2d2::{ConnectionManager, Pool};
use diesel::sql_types::{BigInt, Text};
use diesel::{Connection, QueryableByName, RunQueryDsl};
use diesel_lock::{LockConnection, Locker, Strategy};

/// A cycle through the library and the same statements issued raw, on one pool.
pub struct Pair {
    pub ours: Box<dyn FnMut()>,
    pub raw: Box<dyn FnMut()>,
    /// The statements of one cycle, for the report.
    pub statements: &'static str,
    /// PostgreSQL Row and Lease: the raw floor with releases that do not `pg_notify`, to
    /// measure what the notification costs.
    pub raw_without_notify: Option<Box<dyn FnMut()>>,
}

const OWNER: &str = "bench";
const HOLDER: &str = "bench-holder-0123456789abcdef";

fn build<C: LockConnection>(
    pool: &Pool<ConnectionManager<C>>,
    s: Strategy,
    key: &str,
) -> Locker<C> {
    let l = Locker::builder(pool.clone())
        .strategy(s)
        .owner(OWNER)
        .build()
        .expect("build");
    l.migrate().expect("migrate");
    // Creates whatever rows the key keeps (lease row, FOR UPDATE row, token counter).
    l.lock(key).expect("lock").release().expect("release");
    l
}

fn ours<C: LockConnection>(l: Locker<C>, key: String) -> Box<dyn FnMut()> {
    Box::new(move || l.lock(&key).expect("lock").release().expect("release"))
}

/// The pair for `strategy` on `db`, on a pool of 4 connections.
pub fn pair(db: Db, strategy: Strategy, key: &str) -> Pair {
    let url = super::url(db).expect("url");
    match db {
        #[cfg(feature = "postgres")]
        Db::Postgres => pg::pair(&url, strategy, key),
        #[cfg(feature = "mysql")]
        Db::Mysql => mysql::pair(&url, strategy, key),
        #[cfg(feature = "sqlite")]
        Db::Sqlite => {
            let _ = url;
            sqlite::pair(strategy, key)
        }
        #[allow(unreachable_patterns)]
        _ => unreachable!("backend not compiled in"),
    }
}

#[derive(QueryableByName)]
struct Answer {
    #[diesel(sql_type = diesel::sql_types::Nullable<BigInt>)]
    answer: Option<i64>,
}

#[cfg(feature = "postgres")]
pub mod pg {
    use super::*;
    use chrono::{DateTime, Utc};
    use diesel::sql_types::{Bool, Timestamptz};
    use diesel::PgConnection;

    #[derive(QueryableByName)]
    pub struct Acquired {
        #[diesel(sql_type = BigInt)]
        pub id: i64,
        #[diesel(sql_type = BigInt)]
        pub token: i64,
        #[diesel(sql_type = Timestamptz)]
        pub acquired_at: DateTime<Utc>,
    }

    #[derive(QueryableByName)]
    struct Released {
        #[diesel(sql_type = Bool)]
        released: bool,
    }

    pub const ROW_ACQUIRE: &str = "WITH t AS ( \
               INSERT INTO dlock_tokens AS t (lock_key, token) \
               SELECT ?, 1 WHERE NOT EXISTS (SELECT 1 FROM dlock_rows WHERE lock_key = ?) \
               ON CONFLICT (lock_key) DO UPDATE SET token = t.token + 1 \
               RETURNING token) \
             INSERT INTO dlock_rows (lock_key, owner, holder, token, acquired_at, stale_at) \
             SELECT ?, ?, ?, t.token, now(), now() + ? * interval '1 microsecond' FROM t \
             ON CONFLICT (lock_key) DO NOTHING \
             RETURNING id, token, acquired_at";
    pub const ROW_RELEASE: &str =
        "WITH d AS (DELETE FROM dlock_rows WHERE id = ? RETURNING lock_key) \
             SELECT count(pg_notify('dlock_release', lock_key)) AS n FROM d";
    pub const ROW_RELEASE_SILENT: &str = "DELETE FROM dlock_rows WHERE id = ?";
    pub const LEASE_ACQUIRE: &str = "WITH u AS ( \
               UPDATE dlock_leases SET owner = ?, holder = ?, token = token + 1, \
                 acquired_at = now(), expires_at = now() + ? * interval '1 microsecond' \
               WHERE lock_key = ? AND (holder IS NULL OR expires_at <= now()) \
               RETURNING token, acquired_at), \
             t AS ( \
               INSERT INTO dlock_tokens AS t (lock_key, token) \
               SELECT ?, 1 WHERE NOT EXISTS (SELECT 1 FROM dlock_leases WHERE lock_key = ?) \
               ON CONFLICT (lock_key) DO UPDATE SET token = t.token + 1 \
               RETURNING token), \
             i AS ( \
               INSERT INTO dlock_leases (lock_key, owner, holder, token, acquired_at, expires_at) \
               SELECT ?, ?, ?, t.token, now(), now() + ? * interval '1 microsecond' FROM t \
               ON CONFLICT (lock_key) DO NOTHING \
               RETURNING token, acquired_at) \
             SELECT 0::int8 AS id, token, acquired_at FROM u \
             UNION ALL SELECT 0::int8 AS id, token, acquired_at FROM i";
    pub const LEASE_RELEASE: &str =
        "WITH u AS (UPDATE dlock_leases SET holder = NULL, expires_at = NULL \
                        WHERE lock_key = ? AND holder = ? RETURNING lock_key) \
             SELECT count(pg_notify('dlock_release', lock_key)) AS n FROM u";
    pub const LEASE_RELEASE_SILENT: &str =
        "UPDATE dlock_leases SET holder = NULL, expires_at = NULL \
             WHERE lock_key = ? AND holder = ?";

    #[derive(QueryableByName)]
    struct Count {
        #[diesel(sql_type = BigInt)]
        n: i64,
    }

    pub fn row_acquire(c: &mut PgConnection, key: &str) -> i64 {
        sql(ROW_ACQUIRE)
            .bind::<Text, _>(key)
            .bind::<Text, _>(key)
            .bind::<Text, _>(key)
            .bind::<Text, _>(OWNER)
            .bind::<Text, _>(HOLDER)
            .bind::<diesel::sql_types::Nullable<BigInt>, _>(None::<i64>)
            .get_result::<Acquired>(c)
            .expect("row acquire")
            .id
    }

    pub fn row_release(c: &mut PgConnection, id: i64, notify: bool) {
        let n = if notify {
            sql(ROW_RELEASE)
                .bind::<BigInt, _>(id)
                .get_result::<Count>(c)
                .expect("row release")
                .n as usize
        } else {
            sql(ROW_RELEASE_SILENT)
                .bind::<BigInt, _>(id)
                .execute(c)
                .expect("row release")
        };
        assert_eq!(n, 1);
    }

    pub fn lease_acquire(c: &mut PgConnection, key: &str) {
        sql(LEASE_ACQUIRE)
            .bind::<Text, _>(OWNER)
            .bind::<Text, _>(HOLDER)
            .bind::<BigInt, _>(TTL.as_micros() as i64)
            .bind::<Text, _>(key)
            .bind::<Text, _>(key)
            .bind::<Text, _>(key)
            .bind::<Text, _>(key)
            .bind::<Text, _>(OWNER)
            .bind::<Text, _>(HOLDER)
            .bind::<BigInt, _>(TTL.as_micros() as i64)
            .get_result::<Acquired>(c)
            .expect("lease acquire");
    }

    pub fn lease_release(c: &mut PgConnection, key: &str, notify: bool) {
        let n = if notify {
            sql(LEASE_RELEASE)
                .bind::<Text, _>(key)
                .bind::<Text, _>(HOLDER)
                .get_result::<Count>(c)
                .expect("lease release")
                .n as usize
        } else {
            sql(LEASE_RELEASE_SILENT)
                .bind::<Text, _>(key)
                .bind::<Text, _>(HOLDER)
                .execute(c)
                .expect("lease release")
        };
        assert_eq!(n, 1);
    }

    pub fn pair(url: &str, strategy: Strategy, key: &str) -> Pair {
        let pool = super::super::pool::<PgConnection>(url, 4);
        let l = build(&pool, strategy, key);
        let k = key.to_owned();
        let (p, k2) = (pool.clone(), k.clone());
        let raw_without_notify: Option<Box<dyn FnMut()>> = match strategy {
            Strategy::Row { .. } => Some(Box::new(move || {
                let id = row_acquire(&mut p.get().unwrap(), &k2);
                row_release(&mut p.get().unwrap(), id, false);
            })),
            Strategy::Lease { .. } => Some(Box::new(move || {
                lease_acquire(&mut p.get().unwrap(), &k2);
                lease_release(&mut p.get().unwrap(), &k2, false);
            })),
            _ => None,
        };
        let (raw, statements): (Box<dyn FnMut()>, _) = match strategy {
            Strategy::Row { .. } => (
                Box::new(move || {
                    let id = row_acquire(&mut pool.get().unwrap(), &k);
                    row_release(&mut pool.get().unwrap(), id, true);
                }),
                "INSERT … ON CONFLICT DO NOTHING RETURNING (token CTE); DELETE by id + pg_notify (CTE)",
            ),
            Strategy::Lease { .. } => (
                Box::new(move || {
                    lease_acquire(&mut pool.get().unwrap(), &k);
                    lease_release(&mut pool.get().unwrap(), &k, true);
                }),
                "INSERT … ON CONFLICT DO UPDATE … WHERE free RETURNING; UPDATE … holder = NULL + pg_notify (CTE)",
            ),
                Strategy::ForUpdate => (
                    Box::new(move || {
                        let mut c = pool.get().unwrap();
                        c.transaction(|c| {
                        sql("UPDATE dlock_for_update SET version = version + 1 WHERE lock_key = \
                             (SELECT lock_key FROM dlock_for_update WHERE lock_key = ? FOR UPDATE) \
                             RETURNING version AS id, nextval('dlock_fence_seq') AS token, \
                                       now() AS acquired_at")
                        .bind::<Text, _>(&k)
                        .get_result::<Acquired>(c)
                    })
                    .expect("for update");
                    }),
                    "BEGIN; UPDATE … (SELECT … FOR UPDATE) RETURNING nextval(…); COMMIT",
                ),
                Strategy::Advisory => {
                    let hash = diesel_lock::key_hash(&k);
                    (
                        Box::new(move || {
                            let mut c = pool.get().unwrap();
                            sql("WITH l AS (SELECT pg_advisory_lock(?) AS got) \
                             INSERT INTO dlock_tokens AS t (lock_key, token) SELECT ?, 1 FROM l \
                             ON CONFLICT (lock_key) DO UPDATE SET token = t.token + 1 \
                             RETURNING 0::int8 AS id, token, now() AS acquired_at")
                            .bind::<BigInt, _>(hash)
                            .bind::<Text, _>(&k)
                            .get_result::<Acquired>(&mut c)
                            .expect("advisory lock");
                            let r = sql("SELECT pg_advisory_unlock(?) AS released")
                                .bind::<BigInt, _>(hash)
                                .get_result::<Released>(&mut c)
                                .expect("unlock");
                            assert!(r.released);
                        }),
                        "pg_advisory_lock + token upsert (one statement); pg_advisory_unlock",
                    )
                }
                _ => unreachable!(),
            };
        Pair {
            ours: ours(l, key.to_owned()),
            raw,
            statements,
            raw_without_notify,
        }
    }
}

#[cfg(feature = "mysql")]
pub mod mysql {
    use super::*;
    use chrono::NaiveDateTime;
    use diesel::sql_types::Datetime;
    use diesel::MysqlConnection;

    #[derive(QueryableByName)]
    pub struct Acquired {
        #[diesel(sql_type = BigInt)]
        pub id: i64,
        #[diesel(sql_type = BigInt)]
        pub token: i64,
        #[diesel(sql_type = Datetime)]
        pub acquired_at: NaiveDateTime,
    }

    #[derive(QueryableByName)]
    #[allow(dead_code)]
    struct Locked {
        #[diesel(sql_type = Datetime)]
        acquired_at: NaiveDateTime,
    }

    #[derive(QueryableByName)]
    struct Fence {
        #[diesel(sql_type = BigInt)]
        id: i64,
    }

    pub fn pair(url: &str, strategy: Strategy, key: &str) -> Pair {
        let pool = super::super::pool::<MysqlConnection>(url, 4);
        let l = build(&pool, strategy, key);
        let k = key.to_owned();
        let (raw, statements): (Box<dyn FnMut()>, _) = match strategy {
            Strategy::Row { .. } => (
                Box::new(move || {
                    let mut c = pool.get().unwrap();
                    let n = sql(
                        "INSERT IGNORE INTO dlock_rows (lock_key, owner, holder, token, acquired_at) \
                         VALUES (?, ?, ?, 0, UTC_TIMESTAMP(6))",
                    )
                    .bind::<Text, _>(&k)
                    .bind::<Text, _>(OWNER)
                    .bind::<Text, _>(HOLDER)
                    .execute(&mut c)
                    .unwrap();
                    assert_eq!(n, 1);
                    let a = sql(
                        "SELECT id, token, acquired_at FROM dlock_rows WHERE id = LAST_INSERT_ID()",
                    )
                    .get_result::<Acquired>(&mut c)
                    .unwrap();
                    drop(c);
                    let n = sql("DELETE FROM dlock_rows WHERE id = ?")
                        .bind::<BigInt, _>(a.id)
                        .execute(&mut pool.get().unwrap())
                        .unwrap();
                    assert_eq!(n, 1);
                }),
                "INSERT IGNORE (trigger stamps the token); SELECT by LAST_INSERT_ID(); DELETE by id",
            ),
            Strategy::Lease { .. } => (
                Box::new(move || {
                    let mut c = pool.get().unwrap();
                    sql(
                        "INSERT INTO dlock_leases (lock_key, owner, holder, token, acquired_at, expires_at) \
                         VALUES (?, ?, ?, COALESCE((SELECT token FROM dlock_tokens WHERE lock_key = ?), 0) + 1, \
                                 UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND) \
                         ON DUPLICATE KEY UPDATE \
                           holder = IF(holder IS NULL OR expires_at <= UTC_TIMESTAMP(6), \
                                       VALUES(holder), holder), \
                           token = IF(holder <=> VALUES(holder), token + 1, token), \
                           owner = IF(holder <=> VALUES(holder), VALUES(owner), owner), \
                           acquired_at = IF(holder <=> VALUES(holder), VALUES(acquired_at), acquired_at), \
                           expires_at = IF(holder <=> VALUES(holder), VALUES(expires_at), expires_at)",
                    )
                    .bind::<Text, _>(&k)
                    .bind::<Text, _>(OWNER)
                    .bind::<Text, _>(HOLDER)
                    .bind::<Text, _>(&k)
                    .bind::<BigInt, _>(TTL.as_micros() as i64)
                    .execute(&mut c)
                    .unwrap();
                    sql(
                        "SELECT CAST(0 AS SIGNED) AS id, token, acquired_at FROM dlock_leases \
                         WHERE lock_key = ? AND holder = ?",
                    )
                    .bind::<Text, _>(&k)
                    .bind::<Text, _>(HOLDER)
                    .get_result::<Acquired>(&mut c)
                    .unwrap();
                    drop(c);
                    let n = sql(
                        "UPDATE dlock_leases SET holder = NULL, expires_at = NULL \
                         WHERE lock_key = ? AND holder = ?",
                    )
                    .bind::<Text, _>(&k)
                    .bind::<Text, _>(HOLDER)
                    .execute(&mut pool.get().unwrap())
                    .unwrap();
                    assert_eq!(n, 1);
                }),
                "INSERT … ON DUPLICATE KEY UPDATE; SELECT token; UPDATE … holder = NULL",
            ),
            Strategy::ForUpdate => (
                Box::new(move || {
                    let mut c = pool.get().unwrap();
                    c.transaction(|c| {
                        sql(
                            "SELECT UTC_TIMESTAMP(6) AS acquired_at FROM dlock_for_update \
                             WHERE lock_key = ? FOR UPDATE",
                        )
                        .bind::<Text, _>(&k)
                        .get_result::<Locked>(c)?;
                        sql("INSERT INTO dlock_fences (lock_key) VALUES (?)")
                            .bind::<Text, _>(&k)
                            .execute(c)?;
                        let fence = sql("SELECT id FROM dlock_fences WHERE id = LAST_INSERT_ID()")
                            .get_result::<Fence>(c)?;
                        sql("DELETE FROM dlock_fences WHERE id = ?")
                            .bind::<BigInt, _>(fence.id)
                            .execute(c)
                    })
                    .expect("for update");
                }),
                "BEGIN; SELECT … FOR UPDATE; INSERT fence; SELECT LAST_INSERT_ID(); DELETE fence; COMMIT",
            ),
            Strategy::Advisory => (
                Box::new(move || {
                    let mut c = pool.get().unwrap();
                    let got = sql("SELECT CAST(GET_LOCK(?, 31536000) AS SIGNED) AS answer")
                        .bind::<Text, _>(&k)
                        .get_result::<Answer>(&mut c)
                        .unwrap();
                    assert_eq!(got.answer, Some(1));
                    sql(
                        "INSERT INTO dlock_tokens (lock_key, token) VALUES (?, LAST_INSERT_ID(1)) \
                         ON DUPLICATE KEY UPDATE token = LAST_INSERT_ID(token + 1)",
                    )
                    .bind::<Text, _>(&k)
                    .execute(&mut c)
                    .unwrap();
                    sql(
                        "SELECT CAST(0 AS SIGNED) AS id, CAST(LAST_INSERT_ID() AS SIGNED) AS token, \
                         UTC_TIMESTAMP(6) AS acquired_at",
                    )
                    .get_result::<Acquired>(&mut c)
                    .unwrap();
                    let r = sql("SELECT CAST(RELEASE_LOCK(?) AS SIGNED) AS answer")
                        .bind::<Text, _>(&k)
                        .get_result::<Answer>(&mut c)
                        .unwrap();
                    assert_eq!(r.answer, Some(1));
                }),
                "GET_LOCK; token upsert; SELECT LAST_INSERT_ID(); RELEASE_LOCK",
            ),
            _ => unreachable!(),
        };
        Pair {
            ours: ours(l, key.to_owned()),
            raw,
            statements,
            raw_without_notify: None,
        }
    }
}

#[cfg(feature = "sqlite")]
pub mod sqlite {
    use super::*;
    use chrono::NaiveDateTime;
    use diesel::sql_types::Timestamp;

    #[derive(QueryableByName)]
    pub struct Acquired {
        #[diesel(sql_type = BigInt)]
        pub id: i64,
        #[diesel(sql_type = BigInt)]
        pub token: i64,
        #[diesel(sql_type = Timestamp)]
        pub acquired_at: NaiveDateTime,
    }

    pub fn pair(strategy: Strategy, key: &str) -> Pair {
        let pool = super::super::sqlite_pool(4);
        let l = build(&pool, strategy, key);
        let k = key.to_owned();
        let ttl = format!("+{}.{:06} seconds", TTL.as_secs(), TTL.subsec_micros());
        let (raw, statements): (Box<dyn FnMut()>, _) = match strategy {
            Strategy::Row { .. } => (
                Box::new(move || {
                    let a = sql(
                        "INSERT INTO dlock_rows (lock_key, owner, holder, token, acquired_at) \
                         VALUES (?, ?, ?, COALESCE((SELECT token FROM dlock_tokens WHERE lock_key = ?), 0) + 1, \
                                 strftime('%Y-%m-%d %H:%M:%f', 'now')) \
                         ON CONFLICT (lock_key) DO NOTHING \
                         RETURNING id, token, acquired_at",
                    )
                    .bind::<Text, _>(&k)
                    .bind::<Text, _>(OWNER)
                    .bind::<Text, _>(HOLDER)
                    .bind::<Text, _>(&k)
                    .get_result::<Acquired>(&mut pool.get().unwrap())
                    .unwrap();
                    let n = sql("DELETE FROM dlock_rows WHERE id = ?")
                        .bind::<BigInt, _>(a.id)
                        .execute(&mut pool.get().unwrap())
                        .unwrap();
                    assert_eq!(n, 1);
                }),
                "INSERT … ON CONFLICT DO NOTHING RETURNING (token trigger); DELETE by id",
            ),
            Strategy::Lease { .. } => (
                Box::new(move || {
                    sql(
                        "INSERT INTO dlock_leases (lock_key, owner, holder, token, acquired_at, expires_at) \
                         VALUES (?, ?, ?, COALESCE((SELECT token FROM dlock_tokens WHERE lock_key = ?), 0) + 1, \
                                 strftime('%Y-%m-%d %H:%M:%f', 'now'), \
                                 strftime('%Y-%m-%d %H:%M:%f', 'now', ?)) \
                         ON CONFLICT (lock_key) DO UPDATE SET \
                           owner = excluded.owner, holder = excluded.holder, \
                           token = dlock_leases.token + 1, \
                           acquired_at = excluded.acquired_at, expires_at = excluded.expires_at \
                         WHERE dlock_leases.holder IS NULL \
                            OR dlock_leases.expires_at <= excluded.acquired_at \
                         RETURNING 0 AS id, token, acquired_at",
                    )
                    .bind::<Text, _>(&k)
                    .bind::<Text, _>(OWNER)
                    .bind::<Text, _>(HOLDER)
                    .bind::<Text, _>(&k)
                    .bind::<Text, _>(&ttl)
                    .get_result::<Acquired>(&mut pool.get().unwrap())
                    .unwrap();
                    let n = sql("UPDATE dlock_leases SET holder = NULL, expires_at = NULL \
                         WHERE lock_key = ? AND holder = ?")
                    .bind::<Text, _>(&k)
                    .bind::<Text, _>(HOLDER)
                    .execute(&mut pool.get().unwrap())
                    .unwrap();
                    assert_eq!(n, 1);
                }),
                "INSERT … ON CONFLICT DO UPDATE … WHERE free RETURNING; UPDATE … holder = NULL",
            ),
            _ => unreachable!("sqlite has no session strategies"),
        };
        Pair {
            ours: ours(l, key.to_owned()),
            raw,
            statements,
            raw_without_notify: None,
        }
    }
}
