//! Each strategy × backend's cycle through the library beside its raw floor: the library's
//! own SQL statements (its very texts, from `diesel_lock::__bench_sql`, never a copy), issued
//! in the same order on a connection from the same pool, with no library code around them.

use super::{sql, Db, TTL};
use diesel::r2d2::{ConnectionManager, Pool};
use diesel::sql_types::{BigInt, Text};
use diesel::{QueryableByName, RunQueryDsl};
use diesel_lock::{LockConnection, Locker, Strategy};

/// A cycle of the lock with no token, and its statements (see `Pair::bare`).
pub type Bare = (Box<dyn FnMut()>, &'static str);

/// A cycle through the library and the same statements issued raw, on one pool.
pub struct Pair {
    pub ours: Box<dyn FnMut()>,
    pub raw: Box<dyn FnMut()>,
    /// The statements of one cycle, for the report.
    pub statements: &'static str,
    /// PostgreSQL Row and Lease: the raw floor with plain releases that do not look at the
    /// key's line, to measure what that look costs.
    pub raw_without_notify: Option<Box<dyn FnMut()>>,
    /// Session strategies: the lock alone with no token at all (`pg_advisory_lock` +
    /// `pg_advisory_unlock`, `GET_LOCK` + `RELEASE_LOCK`, `BEGIN; SELECT … FOR UPDATE;
    /// COMMIT`), what a fencing token is measured against, and its statements.
    pub bare: Option<Bare>,
    /// MariaDB Row and Lease: the hand-written statements (`bare`) with what a lock whose
    /// guard keeps no connection needs of them: the token (or id) back to the client, and
    /// the release on a connection checked out again. Through diesel on MariaDB 10.11 a
    /// value comes back from a write only by a statement of its own (no `INSERT …
    /// RETURNING` through a prepared statement, MDEV-27013; no insert id in diesel's API).
    /// PostgreSQL Row: the hand-written statements with a token that grows per key (a
    /// counter's upsert in the insert's statement); its hand-written `Lease` carries one.
    pub bare_token: Option<Bare>,
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
    use diesel::{Connection, PgConnection};
    use diesel_lock::__bench_sql::{pg as lib, shared};

    #[derive(QueryableByName)]
    pub struct Acquired {
        #[diesel(sql_type = BigInt)]
        pub id: i64,
        #[diesel(sql_type = BigInt)]
        pub token: i64,
        #[diesel(sql_type = Timestamptz)]
        pub acquired_at: DateTime<Utc>,
    }

    /// What `LEASE_TAKE` answers.
    #[derive(QueryableByName)]
    pub struct Taken {
        #[diesel(sql_type = diesel::sql_types::Nullable<BigInt>)]
        pub token: Option<i64>,
    }

    #[derive(QueryableByName)]
    struct Released {
        #[diesel(sql_type = Bool)]
        released: bool,
    }

    /// What the session strategies' acquiring statements return.
    #[derive(QueryableByName)]
    #[allow(dead_code)]
    pub struct Fenced {
        #[diesel(sql_type = Bool)]
        pub got: bool,
        #[diesel(sql_type = BigInt)]
        pub id: i64,
        #[diesel(sql_type = diesel::sql_types::Nullable<BigInt>)]
        pub token: Option<i64>,
        #[diesel(sql_type = diesel::sql_types::Nullable<BigInt>)]
        pub high: Option<i64>,
        #[diesel(sql_type = Timestamptz)]
        pub acquired_at: DateTime<Utc>,
    }

    /// The releases' count of notified rows.
    #[derive(QueryableByName)]
    struct One {
        #[diesel(sql_type = BigInt)]
        one: i64,
    }

    pub fn row_acquire(c: &mut PgConnection, key: &str) -> i64 {
        // A newcomer (no place in the key's line), as the library's first attempt binds it.
        sql(lib::ROW_ACQUIRE)
            .bind::<BigInt, _>(diesel_lock::key_hash(key) & 63)
            .bind::<Text, _>(key)
            .bind::<Text, _>(key)
            .bind::<BigInt, _>(i64::MAX)
            .bind::<Text, _>(key)
            .bind::<Text, _>(key)
            .bind::<Text, _>(OWNER)
            .bind::<Text, _>(HOLDER)
            .bind::<diesel::sql_types::Nullable<BigInt>, _>(None::<i64>)
            .get_result::<Acquired>(c)
            .expect("row acquire")
            .id
    }

    /// `notify: true` runs the library's release while nobody is in the key's line (the
    /// DELETE if no place is live; a place sends it to the hand-over statement, which
    /// notifies); `false` the plain DELETE, with no look at the line.
    pub fn row_release(c: &mut PgConnection, id: i64, notify: bool) {
        let n = if notify {
            sql(lib::ROW_RELEASE_ALONE)
                .bind::<BigInt, _>(id)
                .bind::<Text, _>(HOLDER)
                .execute(c)
                .expect("row release")
        } else {
            sql(shared::ROW_RELEASE)
                .bind::<BigInt, _>(id)
                .bind::<Text, _>(HOLDER)
                .execute(c)
                .expect("row release")
        };
        assert_eq!(n, 1);
    }

    /// The acquisition of a key whose row is there (the library's `LEASE_TAKE`; its row was
    /// made by `build`'s first cycle).
    pub fn lease_acquire(c: &mut PgConnection, key: &str) {
        let t = sql(lib::LEASE_TAKE)
            .bind::<Text, _>(key)
            .bind::<BigInt, _>(i64::MAX)
            .bind::<Text, _>(OWNER)
            .bind::<Text, _>(HOLDER)
            .bind::<BigInt, _>(TTL.as_micros() as i64)
            .bind::<Text, _>(key)
            .bind::<Text, _>(key)
            .bind::<Text, _>(key)
            .get_result::<Taken>(c)
            .expect("lease take");
        assert!(t.token.is_some(), "lease take: the key was not free");
    }

    /// `notify: false` as in `row_release`.
    pub fn lease_release(c: &mut PgConnection, key: &str, notify: bool) {
        let n = if notify {
            sql(lib::LEASE_RELEASE_ALONE)
                .bind::<Text, _>(key)
                .bind::<Text, _>(HOLDER)
                .execute(c)
                .expect("lease release")
        } else {
            sql(shared::LEASE_RELEASE)
                .bind::<Text, _>(key)
                .bind::<Text, _>(HOLDER)
                .execute(c)
                .expect("lease release")
        };
        assert_eq!(n, 1);
    }

    /// The hand-written `Row` release, on a connection checked out again: `DELETE` by id.
    fn bare_row_delete(pool: &Pool<ConnectionManager<PgConnection>>, id: i64) {
        let n = sql("DELETE FROM dlock_rows WHERE id = ?")
            .bind::<BigInt, _>(id)
            .execute(&mut pool.get().unwrap())
            .unwrap();
        assert_eq!(n, 1);
    }

    /// `Row`'s hand-written statements with a fencing token (see `Pair::bare_token`): the
    /// per-key counter's upsert in the insert's statement, as the minimal way to hand out a
    /// token that grows per key across holders (a sequence would not: a slow inserter can
    /// win with an older value). `Lease`'s hand-written upsert carries its token already.
    fn bare_token(
        pool: Pool<ConnectionManager<PgConnection>>,
        strategy: Strategy,
        key: &str,
    ) -> Option<Bare> {
        let k = format!("{key}-bare-token");
        match strategy {
            Strategy::Row { .. } => Some((
                Box::new(move || {
                    let mut c = pool.get().unwrap();
                    let a = sql(
                        "WITH t AS (INSERT INTO dlock_tokens AS t (lock_key, token) VALUES (?, 1) \
                                    ON CONFLICT (lock_key) DO UPDATE SET token = t.token + 1 \
                                    RETURNING token) \
                         INSERT INTO dlock_rows (lock_key, owner, holder, token, acquired_at) \
                         SELECT ?, ?, ?, t.token, now() FROM t ON CONFLICT (lock_key) DO NOTHING \
                         RETURNING id, token, acquired_at",
                    )
                    .bind::<Text, _>(&k)
                    .bind::<Text, _>(&k)
                    .bind::<Text, _>(OWNER)
                    .bind::<Text, _>(HOLDER)
                    .get_result::<Acquired>(&mut c)
                    .expect("bare row insert with a token");
                    drop(c);
                    bare_row_delete(&pool, a.id);
                }),
                "counter upsert + INSERT … ON CONFLICT DO NOTHING RETURNING (one statement); DELETE by id",
            )),
            _ => None,
        }
    }

    /// The lock with no token (see `Pair::bare`).
    fn bare(
        pool: Pool<ConnectionManager<PgConnection>>,
        strategy: Strategy,
        key: &str,
    ) -> Option<Bare> {
        let k = key.to_owned();
        match strategy {
            Strategy::Advisory => {
                let hash = diesel_lock::key_hash(&k);
                Some((
                    Box::new(move || {
                        let mut c = pool.get().unwrap();
                        sql("SELECT pg_advisory_lock(?) IS NOT NULL AS released")
                            .bind::<BigInt, _>(hash)
                            .get_result::<Released>(&mut c)
                            .expect("advisory lock");
                        let r = sql("SELECT pg_advisory_unlock(?) AS released")
                            .bind::<BigInt, _>(hash)
                            .get_result::<Released>(&mut c)
                            .expect("unlock");
                        assert!(r.released);
                    }),
                    "pg_advisory_lock; pg_advisory_unlock",
                ))
            }
            Strategy::ForUpdate => Some((
                Box::new(move || {
                    let mut c = pool.get().unwrap();
                    c.transaction(|c| {
                        sql("SELECT 1::int8 AS one FROM dlock_for_update WHERE lock_key = ? FOR UPDATE")
                            .bind::<Text, _>(&k)
                            .get_result::<One>(c)
                    })
                    .expect("for update");
                }),
                "BEGIN; SELECT … FOR UPDATE; COMMIT",
            )),
            Strategy::AdvisoryXact => {
                let hash = diesel_lock::key_hash(&k);
                Some((
                    Box::new(move || {
                        let mut c = pool.get().unwrap();
                        c.transaction(|c| {
                            sql("SELECT pg_advisory_xact_lock(?) IS NOT NULL AS released")
                                .bind::<BigInt, _>(hash)
                                .get_result::<Released>(c)
                        })
                        .expect("advisory xact lock");
                    }),
                    "BEGIN; pg_advisory_xact_lock; COMMIT",
                ))
            }
            // The minimal statements a user would write by hand, with no token counter and
            // no line (on a key of their own).
            Strategy::Row { .. } => {
                let k = format!("{k}-bare");
                Some((
                    Box::new(move || {
                        let mut c = pool.get().unwrap();
                        let a = sql(
                            "INSERT INTO dlock_rows (lock_key, owner, holder, token, acquired_at) \
                             VALUES (?, ?, ?, 0, now()) ON CONFLICT (lock_key) DO NOTHING \
                             RETURNING id, token, acquired_at",
                        )
                        .bind::<Text, _>(&k)
                        .bind::<Text, _>(OWNER)
                        .bind::<Text, _>(HOLDER)
                        .get_result::<Acquired>(&mut c)
                        .expect("bare row insert");
                        drop(c);
                        bare_row_delete(&pool, a.id);
                    }),
                    "INSERT … ON CONFLICT DO NOTHING RETURNING; DELETE by id",
                ))
            }
            Strategy::Lease { .. } => {
                let k = format!("{k}-bare");
                Some((
                    Box::new(move || {
                        let mut c = pool.get().unwrap();
                        sql(
                            "INSERT INTO dlock_leases AS l (lock_key, owner, holder_id, token, acquired_at, expires_at) \
                             VALUES (?, ?, ?, 1, now(), now() + ? * interval '1 microsecond') \
                             ON CONFLICT (lock_key) DO UPDATE SET owner = excluded.owner, \
                               holder_id = excluded.holder_id, token = l.token + 1, \
                               acquired_at = excluded.acquired_at, expires_at = excluded.expires_at \
                             WHERE l.holder_id IS NULL OR l.expires_at <= now() \
                             RETURNING 0::int8 AS id, token, acquired_at",
                        )
                        .bind::<Text, _>(&k)
                        .bind::<Text, _>(OWNER)
                        .bind::<Text, _>(HOLDER)
                        .bind::<BigInt, _>(TTL.as_micros() as i64)
                        .get_result::<Acquired>(&mut c)
                        .expect("bare lease upsert");
                        drop(c);
                        let n = sql(shared::LEASE_RELEASE)
                            .bind::<Text, _>(&k)
                            .bind::<Text, _>(HOLDER)
                            .execute(&mut pool.get().unwrap())
                            .unwrap();
                        assert_eq!(n, 1);
                    }),
                    "INSERT … ON CONFLICT DO UPDATE … WHERE free RETURNING; UPDATE … holder = NULL",
                ))
            }
            _ => None,
        }
    }

    pub fn pair(url: &str, strategy: Strategy, key: &str) -> Pair {
        let pool = super::super::pool::<PgConnection>(url, 4);
        let l = build(&pool, strategy, key);
        let k = key.to_owned();
        let (p, k2) = (pool.clone(), k.clone());
        let pool_for_bare = pool.clone();
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
                "INSERT … ON CONFLICT DO NOTHING RETURNING (token CTE); DELETE by id if nobody is in line",
            ),
            Strategy::Lease { .. } => (
                Box::new(move || {
                    lease_acquire(&mut pool.get().unwrap(), &k);
                    lease_release(&mut pool.get().unwrap(), &k, true);
                }),
                "UPDATE if free RETURNING (the row is there; a first INSERT is a second statement); UPDATE … holder = NULL if the row says nobody is in line",
            ),
            Strategy::ForUpdate => (
                Box::new(move || {
                    let mut c = pool.get().unwrap();
                    c.transaction(|c| {
                        sql(lib::FOR_UPDATE_LOCK)
                            .bind::<Text, _>(&k)
                            .get_result::<Fenced>(c)
                    })
                    .expect("for update");
                }),
                "BEGIN; UPDATE … (SELECT … FOR UPDATE) RETURNING nextval(…) + offset, bound; COMMIT (asynchronous)",
            ),
            Strategy::Advisory => {
                let hash = diesel_lock::key_hash(&k);
                (
                    Box::new(move || {
                        let mut c = pool.get().unwrap();
                        sql(lib::ADVISORY_LOCK)
                            .bind::<BigInt, _>(hash)
                            .get_result::<Fenced>(&mut c)
                            .expect("advisory lock");
                        let r = sql(lib::ADVISORY_UNLOCK)
                            .bind::<BigInt, _>(hash)
                            .get_result::<Released>(&mut c)
                            .expect("unlock");
                        assert!(r.released);
                    }),
                    "pg_advisory_lock + nextval(…) + offset, bound (one statement, asynchronous commit); pg_advisory_unlock",
                )
            }
            Strategy::AdvisoryXact => {
                let hash = diesel_lock::key_hash(&k);
                (
                    Box::new(move || {
                        let mut c = pool.get().unwrap();
                        c.transaction(|c| {
                            sql(lib::ADVISORY_XACT_LOCK)
                                .bind::<BigInt, _>(hash)
                                .get_result::<Fenced>(c)
                        })
                        .expect("advisory xact lock");
                    }),
                    "BEGIN; pg_advisory_xact_lock + nextval(…) + offset, bound (one statement); COMMIT (asynchronous)",
                )
            }
            _ => unreachable!(),
        };
        let bare_token = bare_token(pool_for_bare.clone(), strategy, key);
        let bare = bare(pool_for_bare, strategy, key);
        Pair {
            ours: ours(l, key.to_owned()),
            raw,
            statements,
            raw_without_notify,
            bare,
            bare_token,
        }
    }
}

#[cfg(feature = "mysql")]
pub mod mysql {
    use super::*;
    use chrono::NaiveDateTime;
    use diesel::sql_types::Datetime;
    use diesel::{Connection, MysqlConnection};
    use diesel_lock::__bench_sql::mysql as lib;

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
    struct One {
        #[diesel(sql_type = BigInt)]
        one: i64,
    }

    /// What the releases' first step returns: the first place waiting (none here).
    #[derive(QueryableByName)]
    #[allow(dead_code)]
    struct Place {
        #[diesel(sql_type = BigInt)]
        id: i64,
    }

    /// What MariaDB's session statements return.
    #[derive(QueryableByName)]
    #[allow(dead_code)]
    struct Drawn {
        #[diesel(sql_type = diesel::sql_types::Nullable<BigInt>)]
        token: Option<i64>,
        #[diesel(sql_type = diesel::sql_types::Nullable<BigInt>)]
        high: Option<i64>,
        #[diesel(sql_type = BigInt)]
        acquired_us: i64,
    }

    /// The hand-written `row`'s insert, `bare`'s and `bare_token`'s (its id in
    /// `LAST_INSERT_ID()`).
    fn bare_row_insert(c: &mut MysqlConnection, key: &str) {
        let n = sql(
            "INSERT IGNORE INTO dlock_rows (lock_key, owner, holder, token, acquired_at) \
             VALUES (?, ?, ?, 0, UTC_TIMESTAMP(6))",
        )
        .bind::<Text, _>(key)
        .bind::<Text, _>(OWNER)
        .bind::<Text, _>(HOLDER)
        .execute(c)
        .unwrap();
        assert_eq!(n, 1);
    }

    /// The hand-written statements with the token back (see `Pair::bare_token`): `Row`'s
    /// id (an AUTO_INCREMENT, increasing across the table) read back as its token, and
    /// deleted by it on a second checkout; `Lease`'s upsert bumping a token when it takes
    /// the row, the token read back by holder, the release on a second checkout.
    fn bare_token(
        pool: Pool<ConnectionManager<MysqlConnection>>,
        strategy: Strategy,
        key: &str,
    ) -> Option<Bare> {
        let k = format!("{key}-bare-token");
        match strategy {
            Strategy::Row { .. } => Some((
                Box::new(move || {
                    let mut c = pool.get().unwrap();
                    bare_row_insert(&mut c, &k);
                    let id = sql("SELECT CAST(LAST_INSERT_ID() AS SIGNED) AS answer")
                        .get_result::<Answer>(&mut c)
                        .unwrap()
                        .answer
                        .expect("id");
                    drop(c);
                    let n = sql("DELETE FROM dlock_rows WHERE id = ?")
                        .bind::<BigInt, _>(id)
                        .execute(&mut pool.get().unwrap())
                        .unwrap();
                    assert_eq!(n, 1);
                }),
                "INSERT IGNORE; SELECT LAST_INSERT_ID(); DELETE by id (second checkout)",
            )),
            Strategy::Lease { .. } => Some((
                Box::new(move || {
                    let mut c = pool.get().unwrap();
                    sql(
                        "INSERT INTO dlock_leases (lock_key, owner, holder_id, token, acquired_at, expires_at) \
                         VALUES (?, ?, ?, 1, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND) \
                         ON DUPLICATE KEY UPDATE \
                           token = IF(expires_at IS NULL OR expires_at <= UTC_TIMESTAMP(6), token + 1, token), \
                           holder_id = IF(expires_at IS NULL OR expires_at <= UTC_TIMESTAMP(6), VALUES(holder_id), holder_id), \
                           expires_at = IF(expires_at IS NULL OR expires_at <= UTC_TIMESTAMP(6), VALUES(expires_at), expires_at)",
                    )
                    .bind::<Text, _>(&k)
                    .bind::<Text, _>(OWNER)
                    .bind::<Text, _>(HOLDER)
                    .bind::<BigInt, _>(TTL.as_micros() as i64)
                    .execute(&mut c)
                    .unwrap();
                    let token = sql(
                        "SELECT token AS answer FROM dlock_leases WHERE lock_key = ? AND holder_id = ?",
                    )
                    .bind::<Text, _>(&k)
                    .bind::<Text, _>(HOLDER)
                    .get_result::<Answer>(&mut c)
                    .unwrap()
                    .answer;
                    assert!(token.is_some());
                    drop(c);
                    let n = sql(lib::LEASE_RELEASE)
                        .bind::<Text, _>(&k)
                        .bind::<Text, _>(HOLDER)
                        .execute(&mut pool.get().unwrap())
                        .unwrap();
                    assert_eq!(n, 1);
                }),
                "upsert IF(free) with token + 1; SELECT token by holder; UPDATE … holder = NULL (second checkout)",
            )),
            _ => None,
        }
    }

    /// The lock with no token (see `Pair::bare`).
    fn bare(
        pool: Pool<ConnectionManager<MysqlConnection>>,
        strategy: Strategy,
        key: &str,
    ) -> Option<Bare> {
        let k = key.to_owned();
        match strategy {
            Strategy::Advisory => Some((
                Box::new(move || {
                    let mut c = pool.get().unwrap();
                    let got = sql(lib::GET_LOCK)
                        .bind::<Text, _>(&k)
                        .get_result::<Answer>(&mut c)
                        .unwrap();
                    assert_eq!(got.answer, Some(1));
                    let r = sql(lib::ADVISORY_UNLOCK)
                        .bind::<Text, _>(&k)
                        .get_result::<Answer>(&mut c)
                        .unwrap();
                    assert_eq!(r.answer, Some(1));
                }),
                "GET_LOCK; RELEASE_LOCK",
            )),
            Strategy::ForUpdate => Some((
                Box::new(move || {
                    let mut c = pool.get().unwrap();
                    c.transaction(|c| {
                        sql(lib::FOR_UPDATE_LOCK_ONLY)
                            .bind::<Text, _>(&k)
                            .get_result::<One>(c)
                    })
                    .expect("for update");
                }),
                "BEGIN; SELECT … FOR UPDATE; COMMIT",
            )),
            // The minimal statements a user would write by hand (see the PostgreSQL ones).
            Strategy::Row { .. } => {
                let k = format!("{k}-bare");
                Some((
                    Box::new(move || {
                        let mut c = pool.get().unwrap();
                        bare_row_insert(&mut c, &k);
                        let n = sql("DELETE FROM dlock_rows WHERE id = LAST_INSERT_ID()")
                            .execute(&mut c)
                            .unwrap();
                        assert_eq!(n, 1);
                    }),
                    "INSERT IGNORE; DELETE by LAST_INSERT_ID()",
                ))
            }
            Strategy::Lease { .. } => {
                let k = format!("{k}-bare");
                Some((
                    Box::new(move || {
                        let mut c = pool.get().unwrap();
                        sql(
                            "INSERT INTO dlock_leases (lock_key, owner, holder_id, token, acquired_at, expires_at) \
                             VALUES (?, ?, ?, 1, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND) \
                             ON DUPLICATE KEY UPDATE \
                               holder_id = IF(expires_at IS NULL OR expires_at <= UTC_TIMESTAMP(6), VALUES(holder_id), holder_id), \
                               expires_at = IF(expires_at IS NULL OR expires_at <= UTC_TIMESTAMP(6), VALUES(expires_at), expires_at)",
                        )
                        .bind::<Text, _>(&k)
                        .bind::<Text, _>(OWNER)
                        .bind::<Text, _>(HOLDER)
                        .bind::<BigInt, _>(TTL.as_micros() as i64)
                        .execute(&mut c)
                        .unwrap();
                        drop(c);
                        let n = sql(lib::LEASE_RELEASE)
                            .bind::<Text, _>(&k)
                            .bind::<Text, _>(HOLDER)
                            .execute(&mut pool.get().unwrap())
                            .unwrap();
                        assert_eq!(n, 1);
                    }),
                    "INSERT … ON DUPLICATE KEY UPDATE IF(free); UPDATE … holder = NULL",
                ))
            }
            _ => None,
        }
    }

    pub fn pair(url: &str, strategy: Strategy, key: &str) -> Pair {
        let pool = super::super::pool::<MysqlConnection>(url, 4);
        let l = build(&pool, strategy, key);
        let k = key.to_owned();
        let bare = bare(pool.clone(), strategy, key);
        let pool_for_token = pool.clone();
        let (raw, statements): (Box<dyn FnMut()>, _) = match strategy {
            Strategy::Row { .. } => (
                Box::new(move || {
                    let mut c = pool.get().unwrap();
                    sql(lib::ROW_BUMP)
                        .bind::<Text, _>(&k)
                        .bind::<BigInt, _>(diesel_lock::key_hash(&k) & 63)
                        .execute(&mut c)
                        .unwrap();
                    let n = sql(lib::ROW_INSERT)
                        .bind::<Text, _>(&k)
                        .bind::<Text, _>(OWNER)
                        .bind::<Text, _>(HOLDER)
                        .bind::<diesel::sql_types::Nullable<BigInt>, _>(None::<i64>)
                        .bind::<Text, _>(&k)
                        .execute(&mut c)
                        .unwrap();
                    assert_eq!(n, 1);
                    let a = sql(lib::ROW_READ_BACK)
                        .bind::<BigInt, _>(i64::MAX)
                        .get_result::<Acquired>(&mut c)
                        .unwrap();
                    drop(c);
                    let mut c = pool.get().unwrap();
                    let n = sql(lib::ROW_RELEASE_ALONE)
                        .bind::<BigInt, _>(a.id)
                        .bind::<Text, _>(HOLDER)
                        .bind::<Text, _>(HOLDER)
                        .execute(&mut c)
                        .unwrap();
                    assert_eq!(n, 1);
                }),
                "counter upsert; INSERT IGNORE … SELECT while the counter is ours; SELECT by LAST_INSERT_ID(); DELETE by id and holder if nobody is in line",
            ),
            Strategy::Lease { .. } => (
                Box::new(move || {
                    let mut c = pool.get().unwrap();
                    sql(lib::LEASE_UPSERT)
                        .bind::<Text, _>(&k)
                        .bind::<Text, _>(OWNER)
                        .bind::<Text, _>(HOLDER)
                        .bind::<Text, _>(&k)
                        .bind::<BigInt, _>(TTL.as_micros() as i64)
                        .bind::<BigInt, _>(diesel_lock::key_hash(&k) & 63)
                        .execute(&mut c)
                        .unwrap();
                    sql(lib::LEASE_READ_BACK)
                        .bind::<BigInt, _>(i64::MAX)
                        .bind::<Text, _>(&k)
                        .bind::<Text, _>(HOLDER)
                        .get_result::<Acquired>(&mut c)
                        .unwrap();
                    drop(c);
                    let mut c = pool.get().unwrap();
                    let n = sql(lib::LEASE_RELEASE_ALONE)
                        .bind::<Text, _>(&k)
                        .bind::<Text, _>(HOLDER)
                        .execute(&mut c)
                        .unwrap();
                    assert_eq!(n, 1);
                }),
                "INSERT … ON DUPLICATE KEY UPDATE; SELECT token; UPDATE … holder = NULL if nobody is in line",
            ),
            Strategy::ForUpdate => (
                Box::new(move || {
                    let mut c = pool.get().unwrap();
                    c.transaction(|c| {
                        sql(lib::FOR_UPDATE_LOCK)
                            .bind::<Text, _>(&k)
                            .get_result::<Drawn>(c)
                    })
                    .expect("for update");
                }),
                "BEGIN; SELECT UUID_SHORT() + @offset, @bound … FOR UPDATE; COMMIT",
            ),
            Strategy::Advisory => (
                Box::new(move || {
                    let mut c = pool.get().unwrap();
                    // The library binds the key's GET_LOCK name: the key itself, for a bench
                    // key (lowercase ASCII, at most 64 characters).
                    let got = sql(lib::ADVISORY_LOCK)
                        .bind::<Text, _>(&k)
                        .get_result::<Drawn>(&mut c)
                        .unwrap();
                    assert!(got.token.is_some_and(|t| t > 0));
                    let r = sql(lib::ADVISORY_UNLOCK)
                        .bind::<Text, _>(&k)
                        .get_result::<Answer>(&mut c)
                        .unwrap();
                    assert_eq!(r.answer, Some(1));
                }),
                "GET_LOCK + UUID_SHORT() + @offset, @bound (one statement); RELEASE_LOCK",
            ),
            _ => unreachable!(),
        };
        Pair {
            ours: ours(l, key.to_owned()),
            raw,
            statements,
            raw_without_notify: None,
            bare,
            bare_token: bare_token(pool_for_token, strategy, key),
        }
    }
}

#[cfg(feature = "sqlite")]
pub mod sqlite {
    use super::*;
    use chrono::NaiveDateTime;
    use diesel::sql_types::Timestamp;
    use diesel_lock::__bench_sql::sqlite as lib;

    #[derive(QueryableByName)]
    pub struct Acquired {
        #[diesel(sql_type = BigInt)]
        pub id: i64,
        #[diesel(sql_type = BigInt)]
        pub token: i64,
        #[diesel(sql_type = Timestamp)]
        pub acquired_at: NaiveDateTime,
    }

    /// The minimal statements a user would write by hand (see the PostgreSQL ones).
    fn bare(
        pool: Pool<ConnectionManager<diesel::SqliteConnection>>,
        strategy: Strategy,
        key: &str,
    ) -> Option<Bare> {
        let k = format!("{key}-bare");
        let ttl = format!("+{}.{:06} seconds", TTL.as_secs(), TTL.subsec_micros());
        match strategy {
            Strategy::Row { .. } => Some((
                Box::new(move || {
                    let a = sql(
                        "INSERT INTO dlock_rows (lock_key, owner, holder, token, acquired_at) \
                         VALUES (?, ?, ?, 0, strftime('%Y-%m-%d %H:%M:%f', 'now')) \
                         ON CONFLICT (lock_key) DO NOTHING RETURNING id, token, acquired_at",
                    )
                    .bind::<Text, _>(&k)
                    .bind::<Text, _>(OWNER)
                    .bind::<Text, _>(HOLDER)
                    .get_result::<Acquired>(&mut pool.get().unwrap())
                    .unwrap();
                    let n = sql("DELETE FROM dlock_rows WHERE id = ?")
                        .bind::<BigInt, _>(a.id)
                        .execute(&mut pool.get().unwrap())
                        .unwrap();
                    assert_eq!(n, 1);
                }),
                "INSERT … ON CONFLICT DO NOTHING RETURNING (token trigger); DELETE by id",
            )),
            Strategy::Lease { .. } => Some((
                Box::new(move || {
                    sql(
                        "INSERT INTO dlock_leases (lock_key, owner, holder_id, token, acquired_at, expires_at) \
                         VALUES (?, ?, ?, 1, strftime('%Y-%m-%d %H:%M:%f', 'now'), \
                                 strftime('%Y-%m-%d %H:%M:%f', 'now', ?)) \
                         ON CONFLICT (lock_key) DO UPDATE SET owner = excluded.owner, \
                           holder_id = excluded.holder_id, token = dlock_leases.token + 1, \
                           acquired_at = excluded.acquired_at, expires_at = excluded.expires_at \
                         WHERE dlock_leases.holder_id IS NULL \
                            OR dlock_leases.expires_at <= excluded.acquired_at \
                         RETURNING 0 AS id, token, acquired_at",
                    )
                    .bind::<Text, _>(&k)
                    .bind::<Text, _>(OWNER)
                    .bind::<Text, _>(HOLDER)
                    .bind::<Text, _>(&ttl)
                    .get_result::<Acquired>(&mut pool.get().unwrap())
                    .unwrap();
                    let n = sql(lib::LEASE_RELEASE)
                        .bind::<Text, _>(&k)
                        .bind::<Text, _>(HOLDER)
                        .execute(&mut pool.get().unwrap())
                        .unwrap();
                    assert_eq!(n, 1);
                }),
                "INSERT … ON CONFLICT DO UPDATE … WHERE free RETURNING; UPDATE … holder = NULL",
            )),
            _ => None,
        }
    }

    pub fn pair(strategy: Strategy, key: &str) -> Pair {
        let pool = super::super::sqlite_pool(4);
        let pool_for_bare = pool.clone();
        let l = build(&pool, strategy, key);
        let k = key.to_owned();
        let ttl = format!("+{}.{:06} seconds", TTL.as_secs(), TTL.subsec_micros());
        let (raw, statements): (Box<dyn FnMut()>, _) = match strategy {
            Strategy::Row { .. } => (
                Box::new(move || {
                    let a = sql(lib::ROW_ACQUIRE)
                        .bind::<Text, _>(&k)
                        .bind::<Text, _>(OWNER)
                        .bind::<Text, _>(HOLDER)
                        .bind::<Text, _>(&k)
                        .bind::<BigInt, _>(diesel_lock::key_hash(&k) & 63)
                        // No stale_after: a NULL modifier, as the library binds it.
                        .bind::<diesel::sql_types::Nullable<Text>, _>(None::<String>)
                        .bind::<Text, _>(&k)
                        .bind::<BigInt, _>(i64::MAX)
                        .get_result::<Acquired>(&mut pool.get().unwrap())
                        .unwrap();
                    let n = sql(lib::ROW_RELEASE_ALONE)
                        .bind::<BigInt, _>(a.id)
                        .bind::<Text, _>(HOLDER)
                        .execute(&mut pool.get().unwrap())
                        .unwrap();
                    assert_eq!(n, 1);
                }),
                "INSERT … ON CONFLICT DO NOTHING RETURNING (token trigger); DELETE by id and holder",
            ),
            Strategy::Lease { .. } => (
                Box::new(move || {
                    sql(lib::LEASE_ACQUIRE)
                        .bind::<Text, _>(&k)
                        .bind::<Text, _>(OWNER)
                        .bind::<Text, _>(HOLDER)
                        .bind::<Text, _>(&k)
                        .bind::<BigInt, _>(diesel_lock::key_hash(&k) & 63)
                        .bind::<Text, _>(&ttl)
                        .bind::<diesel::sql_types::Bool, _>(true)
                        .bind::<Text, _>(&k)
                        .bind::<Text, _>(&k)
                        .bind::<BigInt, _>(i64::MAX)
                        .get_result::<Acquired>(&mut pool.get().unwrap())
                        .unwrap();
                    let n = sql(lib::LEASE_RELEASE_ALONE)
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
            bare: bare(pool_for_bare, strategy, key),
            bare_token: None,
        }
    }
}
