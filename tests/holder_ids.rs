//! A `Row` guard matches its own row only: by the row's id *and* its holder id. After a
//! failover to a standby that lagged, the id sequence can hand a held row's id out again, to
//! another holder of the same key (issue 24 saw holder A's row 37 lost with the old primary
//! and id 37 given to C on the new one; A's `check()` then said Ok, and A's `release()`
//! deleted C's row). Here the new primary's state is made directly: A's row is replaced by
//! C's row with the same id, and A must be told it lost the lock and must delete nothing.
//! Force release (admin) still removes C's row, by id and holder.

mod common;

use common::{unique_key, Harness};
use diesel::sql_types::{BigInt, Text};
use diesel::{QueryableByName, RunQueryDsl};
use diesel_lock::{admin, Error, LockConnection, Strategy};

#[derive(QueryableByName)]
struct Id {
    #[diesel(sql_type = BigInt)]
    id: i64,
}

/// What each backend runs (binds: key; id, key): the id of the key's row, and the
/// statements that replace the row of that id with another holder's.
struct Sql {
    row_id: &'static str,
    replace: &'static [&'static str],
}

/// Runs `sql` on `h`'s pool: the backend's own connection type, so that binds typecheck.
macro_rules! sql_fns {
    ($h:expr, $sql:expr) => {{
        let pool = $h.pool.clone();
        let pool2 = $h.pool.clone();
        let sql: &Sql = $sql;
        (
            move |key: &str| -> Option<i64> {
                diesel::sql_query(sql.row_id)
                    .bind::<Text, _>(key)
                    .get_result::<Id>(&mut *pool.get().unwrap())
                    .ok()
                    .map(|r| r.id)
            },
            move |id: i64, key: &str| {
                for statement in sql.replace {
                    diesel::sql_query(*statement)
                        .bind::<BigInt, _>(id)
                        .bind::<Text, _>(key)
                        .execute(&mut *pool2.get().unwrap())
                        .unwrap();
                }
            },
        )
    }};
}

fn reused_id<C: LockConnection>(
    h: &Harness<C>,
    row_id: impl Fn(&str) -> Option<i64>,
    replace: impl Fn(i64, &str),
) {
    let locker = h.locker(Strategy::Row { stale_after: None });
    let key = unique_key("reused-id");
    let a = locker.lock(&key).unwrap();
    let id = row_id(&key).expect("A's row");
    // The new primary: A's row never arrived, C holds the key under the same id.
    replace(id, &key);
    assert_eq!(row_id(&key), Some(id), "C's row has A's old id");

    assert!(
        matches!(a.check(), Err(Error::LockLost { .. })),
        "A's guard must not take C's row (same id, another holder) for its own"
    );
    let released = a.release();
    assert!(
        matches!(released, Err(Error::LockLost { .. })),
        "A's release must report the loss, got {released:?}"
    );
    assert_eq!(row_id(&key), Some(id), "A's release deleted C's row");
    assert!(
        locker.try_lock(&key).unwrap().is_none(),
        "the key is C's: nobody else may take it"
    );

    // An administrator still removes C's row: force release reads id and holder together.
    let removed = admin::force_release(&mut *h.pool.get().unwrap(), &key).unwrap();
    assert_eq!(removed.len(), 1, "force release removes C's row");
    assert_eq!(removed[0].owner, "C");
    assert_eq!(row_id(&key), None);
    assert!(locker.try_lock(&key).unwrap().is_some());
}

#[cfg(feature = "sqlite")]
#[test]
fn sqlite() {
    let Some(h) = common::sqlite() else { return };
    static SQL: std::sync::OnceLock<Sql> = std::sync::OnceLock::new();
    let sql = SQL.get_or_init(|| Sql {
        row_id: "SELECT id FROM dlock_rows WHERE lock_key = ?",
        replace: &[
            "DELETE FROM dlock_rows WHERE id = ? AND lock_key = ?",
            "INSERT INTO dlock_rows (id, lock_key, owner, holder, token, acquired_at) \
                 VALUES (?, ?, 'C', 'holder-of-c', 999, strftime('%Y-%m-%d %H:%M:%f', 'now'))",
        ],
    });
    let (row_id, replace) = sql_fns!(h, sql);
    reused_id(&h, row_id, replace);
}

#[cfg(feature = "postgres")]
#[test]
fn postgres() {
    let Some(h) = common::pg() else { return };
    static SQL: std::sync::OnceLock<Sql> = std::sync::OnceLock::new();
    let sql = SQL.get_or_init(|| Sql {
        row_id: "SELECT id FROM dlock_rows WHERE lock_key = $1",
        replace: &[
            "DELETE FROM dlock_rows WHERE id = $1 AND lock_key = $2",
            "INSERT INTO dlock_rows (id, lock_key, owner, holder, token, acquired_at) \
                 OVERRIDING SYSTEM VALUE VALUES ($1, $2, 'C', 'holder-of-c', 999, now())",
        ],
    });
    let (row_id, replace) = sql_fns!(h, sql);
    reused_id(&h, row_id, replace);
}

#[cfg(feature = "mysql")]
#[test]
fn mysql() {
    let Some(h) = common::mysql() else { return };
    static SQL: std::sync::OnceLock<Sql> = std::sync::OnceLock::new();
    let sql = SQL.get_or_init(|| Sql {
        row_id: "SELECT id FROM dlock_rows WHERE lock_key = ?",
        replace: &[
            "DELETE FROM dlock_rows WHERE id = ? AND lock_key = ?",
            "INSERT INTO dlock_rows (id, lock_key, owner, holder, token, acquired_at) \
                 VALUES (?, ?, 'C', 'holder-of-c', 999, UTC_TIMESTAMP(6))",
        ],
    });
    let (row_id, replace) = sql_fns!(h, sql);
    reused_id(&h, row_id, replace);
}
