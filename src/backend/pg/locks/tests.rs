//! `locks.rs`'s statements against a real PostgreSQL server: the races of the line's
//! `line_free` flag.

use super::*;
use crate::backend::sealed::{Dialect, Lines};
use crate::backend::Line;
use diesel::Connection;
use std::time::{Duration, Instant};

fn url() -> Option<String> {
    crate::test_env::server_url("DLOCK_TEST_PG_URL", "pg")
}

fn key(what: &str) -> String {
    format!(
        "unit-{what}-{}-{}",
        std::process::id(),
        crate::random::holder_id()
    )
}

#[derive(diesel::QueryableByName)]
struct Free {
    #[diesel(sql_type = diesel::sql_types::Bool)]
    line_free: bool,
}

fn line_free(c: &mut PgConnection, key: &str) -> bool {
    stmt("SELECT line_free FROM dlock_leases WHERE lock_key = ?")
        .bind::<Text, _>(key)
        .get_result::<Free>(c)
        .unwrap()
        .line_free
}

#[derive(diesel::QueryableByName)]
struct Pid {
    #[diesel(sql_type = diesel::sql_types::Integer)]
    pid: i32,
}

#[derive(diesel::QueryableByName)]
struct Waiting {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    n: i64,
}

/// Until session `pid` waits for a lock (pg_locks), watched from `watch`.
fn until_waiting(watch: &mut PgConnection, pid: i32) {
    let start = Instant::now();
    while stmt("SELECT count(*) AS n FROM pg_locks WHERE pid = ? AND NOT granted")
        .bind::<diesel::sql_types::Integer, _>(pid)
        .get_result::<Waiting>(watch)
        .unwrap()
        .n
        == 0
    {
        assert!(start.elapsed() < Duration::from_secs(20), "never waited");
        std::thread::sleep(Duration::from_millis(2));
    }
}

const TTL_US: i64 = 60_000_000;

/// A join that does not ask for it (`flag` false: the place of a strategy other than
/// `Lease` on a key that also has a lease row) leaves the row's `line_free` alone; one
/// that asks clears it.
#[test]
fn a_join_marks_the_lease_row_only_when_asked() {
    let Some(url) = url() else { return };
    let mut a = PgConnection::establish(&url).unwrap();
    a.run_migrations().unwrap();
    let k = key("join-flag");
    assert!(a
        .lease_acquire(&k, "o", "h1", TTL_US, false, NO_PLACE)
        .unwrap()
        .is_some());
    assert!(a.lease_release(&k, "h1").unwrap());
    assert!(line_free(&mut a, &k));
    let other = a
        .line_join(&k, Line::Row, "o", None, TTL_US, "hr", false, false)
        .unwrap();
    assert!(
        line_free(&mut a, &k),
        "a join without `flag` marked the row"
    );
    assert!(!a.line_leave(&k, Line::Row, other.id).unwrap());
    let lease = a
        .line_join(&k, Line::Lease, "o", None, TTL_US, "hl", false, true)
        .unwrap();
    assert!(
        !line_free(&mut a, &k),
        "a join with `flag` left the row free"
    );
    assert!(!a.line_leave(&k, Line::Lease, lease.id).unwrap());
}

/// The race that decides `line_free`: a release that finds nobody in line in its snapshot
/// while a join, not committed yet, holds the lease row (marked as waited for, one join
/// more). The release waits for the row, and must not mark the line free once it has
/// it: the join's place is there. A newcomer then does not take the key past the place.
#[test]
fn a_release_does_not_free_the_line_past_a_join_it_could_not_see() {
    let Some(url) = url() else { return };
    let mut a = PgConnection::establish(&url).unwrap();
    a.run_migrations().unwrap();
    let mut j = PgConnection::establish(&url).unwrap();
    let mut watch = PgConnection::establish(&url).unwrap();
    let k = key("free-race");
    // The first holder inserts the row, not marked free (see `lease_acquire!`); its
    // release, which looks into the line, marks it free.
    assert!(a
        .lease_acquire(&k, "o", "h1", TTL_US, false, NO_PLACE)
        .unwrap()
        .is_some());
    assert!(!line_free(&mut a, &k));
    assert!(a.lease_release(&k, "h1").unwrap());
    assert!(
        line_free(&mut a, &k),
        "a release with nobody in line frees the line"
    );
    // Held again, and waited for by a place that left: the row is not marked free, so
    // that the release takes the hand-over statement, which looks into the line.
    assert!(a
        .lease_acquire(&k, "o", "h2", TTL_US, false, NO_PLACE)
        .unwrap()
        .is_some());
    let left = j
        .line_join(&k, Line::Lease, "o", None, TTL_US, "hl", false, true)
        .unwrap();
    assert!(!j.line_leave(&k, Line::Lease, left.id).unwrap());
    assert!(!line_free(&mut a, &k));
    // A join that stays open, holding the row: the release's snapshot cannot see its
    // place, and its UPDATE waits for the row.
    stmt("BEGIN").execute(&mut j).unwrap();
    let joined = j
        .line_join(&k, Line::Lease, "o", None, TTL_US, "hj", false, true)
        .unwrap();
    let pid = stmt("SELECT pg_backend_pid() AS pid")
        .get_result::<Pid>(&mut a)
        .unwrap()
        .pid;
    let key2 = k.clone();
    let release = std::thread::spawn(move || {
        let ok = a.lease_release(&key2, "h2").unwrap();
        (a, ok)
    });
    until_waiting(&mut watch, pid);
    stmt("COMMIT").execute(&mut j).unwrap();
    let (mut a, ok) = release.join().unwrap();
    assert!(ok, "the holder's release");
    assert!(!line_free(&mut a, &k), "the join's place waits");
    assert!(
        a.lease_acquire(&k, "o", "hn", TTL_US, false, NO_PLACE)
            .unwrap()
            .is_none(),
        "a newcomer took the key past a waiter's place"
    );
    // The waiter takes it, and its release (the line empty again) frees the line.
    assert!(j
        .lease_acquire(&k, "o", "hj", TTL_US, true, joined.id)
        .unwrap()
        .is_some());
    assert!(j.lease_release(&k, "hj").unwrap());
    assert!(line_free(&mut j, &k));
    stmt("DELETE FROM dlock_leases WHERE lock_key = ?")
        .bind::<Text, _>(&k)
        .execute(&mut j)
        .unwrap();
}

#[derive(diesel::QueryableByName)]
struct Marks {
    #[diesel(sql_type = diesel::sql_types::Bool)]
    line_free: bool,
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    line_joins: i64,
    #[diesel(sql_type = diesel::sql_types::Nullable<Text>)]
    holder_id: Option<String>,
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    token: i64,
}

fn marks(c: &mut PgConnection, key: &str) -> Marks {
    stmt("SELECT line_free, line_joins, holder_id, token FROM dlock_leases WHERE lock_key = ?")
        .bind::<Text, _>(key)
        .get_result::<Marks>(c)
        .unwrap()
}

fn forget(c: &mut PgConnection, k: &str) {
    for sql in [
        "DELETE FROM dlock_waiters WHERE lock_key = ?",
        "DELETE FROM dlock_leases WHERE lock_key = ?",
    ] {
        stmt(sql).bind::<Text, _>(k).execute(c).unwrap();
    }
}

/// A join that meets a newcomer's insert of the key's lease row, not committed yet, waits
/// for it and marks the row (a join that marked nothing let the newcomer's release, whose
/// snapshot came before the place, say nobody waits, and the next newcomer took the key
/// past the place). The newcomer's release then hands the key to the place.
#[test]
fn a_join_that_meets_an_uncommitted_row_marks_it() {
    let Some(url) = url() else { return };
    let mut n = PgConnection::establish(&url).unwrap();
    n.run_migrations().unwrap();
    let mut j = PgConnection::establish(&url).unwrap();
    let mut watch = PgConnection::establish(&url).unwrap();
    let k = key("flag-late");
    stmt("BEGIN").execute(&mut n).unwrap();
    assert!(n
        .lease_acquire(&k, "o", "hn", TTL_US, false, NO_PLACE)
        .unwrap()
        .is_some());
    let jpid = stmt("SELECT pg_backend_pid() AS pid")
        .get_result::<Pid>(&mut j)
        .unwrap()
        .pid;
    let joining = {
        let k = k.clone();
        std::thread::spawn(move || {
            let joined = j
                .line_join(&k, Line::Lease, "o", None, TTL_US, "hj", false, true)
                .unwrap();
            (j, joined)
        })
    };
    until_waiting(&mut watch, jpid);
    stmt("COMMIT").execute(&mut n).unwrap();
    let (mut j, joined) = joining.join().unwrap();
    let m = marks(&mut n, &k);
    assert!(
        !m.line_free,
        "the join marked the row once it was committed"
    );
    assert_eq!(m.line_joins, 1);
    assert!(n.lease_release(&k, "hn").unwrap());
    assert!(!line_free(&mut n, &k), "the place still waits");
    assert!(
        j.line_look_lease(&k, joined.id, 0, "hj")
            .unwrap()
            .is_some_and(|s| s.granted),
        "the release granted the key to the place"
    );
    forget(&mut j, &k);
}

/// A join on a key without a lease row (never used, or purged) makes the row, free and
/// marked, with its token at the token floor: a newcomer then waits its turn, and the
/// waiter takes the key with a token above every earlier holder's.
#[test]
fn a_join_on_a_key_without_a_row_makes_it_marked() {
    let Some(url) = url() else { return };
    let mut n = PgConnection::establish(&url).unwrap();
    n.run_migrations().unwrap();
    let mut j = PgConnection::establish(&url).unwrap();
    let k = key("flag-none");
    let first = n
        .lease_acquire(&k, "o", "h0", TTL_US, false, NO_PLACE)
        .unwrap()
        .unwrap()
        .token;
    assert!(n.lease_release(&k, "h0").unwrap());
    // As a purge deletes a free row: its token goes to the token floor first.
    stmt("UPDATE dlock_token_floor SET floor_token = GREATEST(floor_token, ?) WHERE bucket = ?")
        .bind::<diesel::sql_types::BigInt, _>(first)
        .bind::<diesel::sql_types::BigInt, _>(crate::key::floor_bucket(&k))
        .execute(&mut n)
        .unwrap();
    stmt("DELETE FROM dlock_leases WHERE lock_key = ?")
        .bind::<Text, _>(&k)
        .execute(&mut n)
        .unwrap();
    let joined = j
        .line_join(&k, Line::Lease, "o", None, TTL_US, "hj", false, true)
        .unwrap();
    let m = marks(&mut n, &k);
    assert!(!m.line_free);
    assert_eq!(m.line_joins, 1);
    assert_eq!(m.holder_id, None, "made free");
    assert!(m.token >= first);
    assert!(
        n.lease_acquire(&k, "o", "hn", TTL_US, false, NO_PLACE)
            .unwrap()
            .is_none(),
        "a newcomer waits its turn"
    );
    let taken = j
        .lease_acquire(&k, "o", "hj", TTL_US, true, joined.id)
        .unwrap()
        .expect("the waiter's turn");
    assert!(taken.token > first, "{} after {first}", taken.token);
    forget(&mut j, &k);
}

/// The grant statements send the grant's note to the grants channel of the listeners that
/// hear one there, by the prefix and suffix `listen.rs` names them with.
#[test]
fn grants_go_to_the_grants_channel_of_listeners_that_hear_them() {
    use crate::backend::pg::listen::{GRANTS, TOLD};
    let sql = grant_notify!();
    assert!(sql.contains(&format!("left(channel, {}) = '{TOLD}'", TOLD.len())));
    assert!(sql.contains(&format!("channel || '{GRANTS}'")));
    assert!(super::ROW_RELEASE.contains(sql));
    assert!(super::LEASE_RELEASE.contains(sql));
}
