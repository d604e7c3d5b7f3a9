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
    assert!(!other.flagged);
    assert!(
        line_free(&mut a, &k),
        "a join without `flag` marked the row"
    );
    assert!(!a.line_leave(&k, Line::Row, other.id).unwrap());
    let lease = a
        .line_join(&k, Line::Lease, "o", None, TTL_US, "hl", false, true)
        .unwrap();
    assert!(lease.flagged);
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
    assert!(joined.flagged);
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

/// A join that found no lease row to mark (the row's insert not committed yet) says so,
/// and `line_flag` marks the row once it is there: the holder's release then looks into
/// the line and grants the key to the place.
#[test]
fn a_join_that_met_no_row_marks_it_after() {
    let Some(url) = url() else { return };
    let mut n = PgConnection::establish(&url).unwrap();
    n.run_migrations().unwrap();
    let mut j = PgConnection::establish(&url).unwrap();
    let k = key("flag-late");
    stmt("BEGIN").execute(&mut n).unwrap();
    assert!(n
        .lease_acquire(&k, "o", "hn", TTL_US, false, NO_PLACE)
        .unwrap()
        .is_some());
    let joined = j
        .line_join(&k, Line::Lease, "o", None, TTL_US, "hj", false, true)
        .unwrap();
    assert!(!joined.flagged, "the row was not committed");
    stmt("COMMIT").execute(&mut n).unwrap();
    // Freed with nobody in line (the place is ignored: a stand-in for a release whose
    // snapshot came before the join), then taken again by a newcomer.
    stmt("UPDATE dlock_leases SET line_free = true WHERE lock_key = ?")
        .bind::<Text, _>(&k)
        .execute(&mut n)
        .unwrap();
    assert!(j
        .lease_acquire(&k, "o", "hj", TTL_US, true, joined.id)
        .unwrap()
        .is_none());
    j.line_flag(&k).unwrap();
    assert!(!line_free(&mut n, &k));
    assert!(n.lease_release(&k, "hn").unwrap());
    assert!(
        j.line_look_lease(&k, joined.id, 0, "hj")
            .unwrap()
            .is_some_and(|s| s.granted),
        "the release granted the key to the place"
    );
    stmt("DELETE FROM dlock_waiters WHERE lock_key = ?")
        .bind::<Text, _>(&k)
        .execute(&mut j)
        .unwrap();
    stmt("DELETE FROM dlock_leases WHERE lock_key = ?")
        .bind::<Text, _>(&k)
        .execute(&mut j)
        .unwrap();
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
