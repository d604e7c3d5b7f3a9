//! `optimistic::transaction` on every backend: concurrent read-merge-write loses no update.

mod common;

use common::{unique_key, Harness};
use diesel::connection::SimpleConnection;
use diesel::sql_types::Text;
use diesel::{QueryableByName, RunQueryDsl};
use diesel_lock::{optimistic, Error, LockConnection, Strategy};
use std::sync::{Arc, Barrier};

#[derive(QueryableByName)]
struct Doc {
    #[diesel(sql_type = Text)]
    body: String,
}

/// A document table, per backend.
trait DocDb: LockConnection {
    fn doc_create(&mut self, name: &str);
    fn doc_read(&mut self, name: &str) -> diesel::QueryResult<String>;
    fn doc_write(&mut self, name: &str, body: &str) -> diesel::QueryResult<usize>;
}

/// `$ph` gives the n-th placeholder of the backend.
macro_rules! doc_db {
    ($conn:ty, $ph:expr) => {
        impl DocDb for $conn {
            fn doc_create(&mut self, name: &str) {
                let ph: fn(usize) -> String = $ph;
                self.batch_execute(
                    "CREATE TABLE IF NOT EXISTS dlock_test_docs (
                        name VARCHAR(255) PRIMARY KEY, body TEXT NOT NULL)",
                )
                .unwrap();
                diesel::sql_query(format!(
                    "INSERT INTO dlock_test_docs (name, body) VALUES ({}, '[]')",
                    ph(1)
                ))
                .bind::<Text, _>(name)
                .execute(self)
                .unwrap();
            }
            fn doc_read(&mut self, name: &str) -> diesel::QueryResult<String> {
                let ph: fn(usize) -> String = $ph;
                diesel::sql_query(format!(
                    "SELECT body FROM dlock_test_docs WHERE name = {}",
                    ph(1)
                ))
                .bind::<Text, _>(name)
                .get_result::<Doc>(self)
                .map(|d| d.body)
            }
            fn doc_write(&mut self, name: &str, body: &str) -> diesel::QueryResult<usize> {
                let ph: fn(usize) -> String = $ph;
                diesel::sql_query(format!(
                    "UPDATE dlock_test_docs SET body = {} WHERE name = {}",
                    ph(1),
                    ph(2)
                ))
                .bind::<Text, _>(body)
                .bind::<Text, _>(name)
                .execute(self)
            }
        }
    };
}

doc_db!(diesel::SqliteConnection, |_| "?".to_owned());
#[cfg(feature = "postgres")]
doc_db!(diesel::PgConnection, |n| format!("${n}"));
#[cfg(feature = "mysql")]
doc_db!(diesel::MysqlConnection, |_| "?".to_owned());

/// 8 threads each add `rounds` entries to a JSON-ish list kept in one text field, by reading
/// it, merging their entry in and writing it back: a lost update loses an entry.
fn read_merge_write<C: DocDb>(h: &Harness<C>, threads: usize, rounds: usize) {
    h.locker(Strategy::Row { stale_after: None }); // migrates
    let name = unique_key("doc");
    h.pool.get().unwrap().doc_create(&name);
    let start = Arc::new(Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (pool, name, start) = (h.pool.clone(), name.clone(), start.clone());
            std::thread::spawn(move || {
                let mut conn = pool.get().unwrap();
                start.wait();
                for r in 0..rounds {
                    let entry = format!("\"t{t}-{r}\"");
                    optimistic::transaction(&mut *conn, &name, 1000, |c, _version| {
                        let body = c.doc_read(&name)?;
                        let merged = if body == "[]" {
                            format!("[{entry}]")
                        } else {
                            format!("{},{entry}]", body.trim_end_matches(']'))
                        };
                        c.doc_write(&name, &merged)
                    })
                    .unwrap();
                }
            })
        })
        .collect();
    for handle in handles {
        handle.join().unwrap();
    }
    let body = h.pool.get().unwrap().doc_read(&name).unwrap();
    let mut entries: Vec<&str> = body.trim_matches(['[', ']']).split(',').collect();
    entries.sort_unstable();
    let mut expected: Vec<String> = (0..threads)
        .flat_map(|t| (0..rounds).map(move |r| format!("\"t{t}-{r}\"")))
        .collect();
    expected.sort_unstable();
    assert_eq!(entries, expected, "lost or duplicated updates");
}

/// A version that changes under every attempt ends in `Conflict` after exactly `attempts`.
fn conflict_after_attempts<C: LockConnection>(h: &Harness<C>) {
    h.locker(Strategy::Row { stale_after: None });
    let key = unique_key("conflict");
    let mut a = h.pool.get().unwrap();
    let pool = h.pool.clone();
    let mut runs = 0;
    let result = optimistic::transaction(&mut *a, &key, 3, |_c, _v| {
        runs += 1;
        // Another writer commits for the key while this attempt is under way.
        let mut b = pool.get().unwrap();
        optimistic::transaction(&mut *b, &key, 1, |_, _| Ok::<_, Error>(()))
    });
    match result {
        Err(Error::Conflict { key: k, attempts }) => {
            assert_eq!((k.as_str(), attempts), (key.as_str(), 3));
        }
        other => panic!("expected Conflict, got {other:?}"),
    }
    assert_eq!(runs, 3);
}

#[test]
fn sqlite_read_merge_write() {
    let h = common::sqlite().unwrap();
    read_merge_write(&h, 8, 25);
}

#[test]
fn sqlite_conflict_after_attempts() {
    // SQLite has one writer at a time: the inner writer would wait for the outer
    // transaction's lock; with a deferred transaction that has only read, it can commit.
    conflict_after_attempts(&common::sqlite().unwrap());
}

#[cfg(feature = "postgres")]
#[test]
fn pg_read_merge_write() {
    if let Some(h) = common::pg() {
        read_merge_write(&h, 8, 25);
    }
}

#[cfg(feature = "postgres")]
#[test]
fn pg_conflict_after_attempts() {
    if let Some(h) = common::pg() {
        conflict_after_attempts(&h);
    }
}

#[cfg(feature = "mysql")]
#[test]
fn mysql_read_merge_write() {
    if let Some(h) = common::mysql() {
        read_merge_write(&h, 8, 25);
    }
}

#[cfg(feature = "mysql")]
#[test]
fn mysql_conflict_after_attempts() {
    if let Some(h) = common::mysql() {
        conflict_after_attempts(&h);
    }
}

#[test]
fn refuses_bad_input_before_sql() {
    let h = common::sqlite().unwrap();
    let mut c = h.pool.get().unwrap();
    assert!(matches!(
        optimistic::transaction(&mut *c, "", 3, |_, _| Ok::<_, Error>(())),
        Err(Error::InvalidKey { .. })
    ));
    assert!(matches!(
        optimistic::transaction(&mut *c, "k", 0, |_, _| Ok::<_, Error>(())),
        Err(Error::InvalidConfig(_))
    ));
}

/// An error of `f`'s is returned at once, and `f` runs once; contention met by `f`'s
/// statements counts as a conflict and is retried, as documented (the docs used to say that
/// no error of `f`'s was ever retried).
fn errors_of_f<C: LockConnection>(h: &Harness<C>, busy: &str) {
    drop(h.locker(Strategy::default())); // migrates
    let key = unique_key("f-error");
    let mut conn = h.pool.get().unwrap();
    let error = |message: &str| {
        diesel::result::Error::DatabaseError(
            diesel::result::DatabaseErrorKind::Unknown,
            Box::new(message.to_owned()),
        )
    };
    let mut calls = 0;
    let result = optimistic::transaction(&mut *conn, &key, 5, |_, _| {
        calls += 1;
        Err::<(), _>(error("value too long for type character varying(3)"))
    });
    assert!(matches!(result, Err(Error::Database(_))), "{result:?}");
    assert_eq!(calls, 1, "a plain error of f's was retried");

    let mut calls = 0;
    let result = optimistic::transaction(&mut *conn, &key, 3, |_, _| {
        calls += 1;
        Err::<(), _>(error(busy))
    });
    assert!(
        matches!(result, Err(Error::Conflict { attempts: 3, .. })),
        "{result:?}"
    );
    assert_eq!(calls, 3, "contention met by f is a conflict, retried");
}

#[test]
fn sqlite_errors_of_f() {
    errors_of_f(&common::sqlite().unwrap(), "database is locked");
}

#[cfg(feature = "postgres")]
#[test]
fn pg_errors_of_f() {
    if let Some(h) = common::pg() {
        errors_of_f(&h, "deadlock detected");
    }
}

#[cfg(feature = "mysql")]
#[test]
fn mysql_errors_of_f() {
    if let Some(h) = common::mysql() {
        errors_of_f(
            &h,
            "Deadlock found when trying to get lock; try restarting transaction",
        );
    }
}
