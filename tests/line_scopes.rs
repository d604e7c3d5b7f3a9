//! Each lock has a line of its own. `dlock_waiters` holds the places of several locks that
//! share a key's name: a `Row` lock "k", a `Lease` lock "k" (its exclusive lease, readers
//! and permits: one lock, one line), `ForUpdate` permits of "k" and `Advisory` permits of
//! "k" are four different locks. A waiter for one of them holds up no newcomer of another
//! (no barging is a rule within a lock's line), and a release of one hands nothing to a
//! place in another's line. With the configuration a user gets from
//! `Locker::connect(url)?`, on every backend where the locks exist (and through PgBouncer):
//! `ForUpdate` permits on PostgreSQL and MySQL/MariaDB, `Advisory` permits on PostgreSQL
//! (not through PgBouncer, whose transaction pooling hands a session lock's server session
//! to other clients).
//!
//! The observables are structural, read right after the step under test: whether a
//! `try_*` got the lock, whom `admin::lock_info` names as the holder right after a release
//! (a hand-over writes the place's owner into the lock in the releasing statement), and
//! whether a place in `dlock_waiters` is marked `granted_at`. Waiters are threads, each
//! with a `Locker` of its own (as separate processes would have); the test waits for their
//! places to show (polling with a deadline), never for a time.

mod common;

use diesel::r2d2::{ConnectionManager, Pool};
use diesel::RunQueryDsl;
use diesel_lock::{admin, connect, AnyConnection, LockGuard, Locker, Strategy, StrategyKind};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The permits of the semaphores of these tests: one, so that a single holder leaves none
/// free and the next permit waiter takes a place. One number for every strategy: a key
/// name's number of permits is stored once (`dlock_shared_keys`), for the `Lease`,
/// `ForUpdate` and `Advisory` semaphores of that name alike; another would be
/// `Error::Permits`.
const PERMITS: u32 = 1;

/// How long a waiter waits for its lock at most (its `try_*_for` deadline): far beyond
/// any hand-over here; it only keeps a thread of a failed test from waiting for ever.
const WAIT: Duration = Duration::from_secs(20);

/// How long a waiter may take to be served once the lock it waits for is released, or to
/// show its place: a liveness bound only (no assertion here is about time).
const BOUND: Duration = Duration::from_secs(8);

type AdminPool = Pool<ConnectionManager<AnyConnection>>;

fn strategy(name: &str) -> Strategy {
    match name {
        "row" => Strategy::Row { stale_after: None },
        "lease" => Strategy::Lease {
            ttl: Duration::from_secs(10),
        },
        "for_update" => Strategy::ForUpdate,
        "advisory" => Strategy::Advisory,
        other => panic!("unknown strategy {other}"),
    }
}

/// The URL of a backend under test (a SQLite file in `dir`).
fn url(backend: &str, dir: &tempfile::TempDir) -> Option<String> {
    match backend {
        "sqlite" => Some(dir.path().join("scopes.db").to_str().unwrap().to_owned()),
        "pg" => common::url("DLOCK_TEST_PG_URL", "pg"),
        "pgbouncer" => common::url("DLOCK_TEST_PGBOUNCER_URL", "pgbouncer"),
        _ => common::url("DLOCK_TEST_MYSQL_URL", "mysql"),
    }
}

/// What a test runs against: the backend's URL (a SQLite file in the temp dir), its tables
/// migrated, and a pool for `admin` and the reads of the line.
struct Db {
    _dir: tempfile::TempDir,
    backend: &'static str,
    url: String,
    admin: AdminPool,
}

/// `None` where the backend is not configured (the test then returns at once; see
/// `common::url` for `DLOCK_TEST_REQUIRE`).
fn db(backend: &'static str) -> Option<Db> {
    let dir = tempfile::tempdir().unwrap();
    let url = url(backend, &dir)?;
    Locker::connect(&url)
        .unwrap()
        .build()
        .unwrap()
        .migrate()
        .unwrap();
    let admin = connect(&url).unwrap();
    Some(Db {
        _dir: dir,
        backend,
        url,
        admin,
    })
}

#[derive(diesel::QueryableByName)]
struct Counts {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    waiting: i64,
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    granted: i64,
}

impl Db {
    /// A `Locker` of strategy `s` whose owner (written into its places and its locks) is
    /// `owner`.
    fn locker(&self, s: &str, owner: &str) -> Locker<AnyConnection> {
        Locker::connect(&self.url)
            .unwrap()
            .strategy(strategy(s))
            .owner(owner)
            .build()
            .unwrap()
    }

    /// `sql` with its `?` numbered for PostgreSQL (`$1`, `$2`, …), and `lock_key = ?`
    /// compared as bytes on MySQL (the column is VARBINARY).
    fn sql(&self, sql: &str) -> String {
        match self.backend {
            "pg" | "pgbouncer" => {
                let mut n = 0;
                sql.split('?')
                    .enumerate()
                    .map(|(i, part)| {
                        if i == 0 {
                            part.to_owned()
                        } else {
                            n += 1;
                            format!("${n}{part}")
                        }
                    })
                    .collect()
            }
            "mysql" => sql.replace("lock_key = ?", "lock_key = CAST(? AS BINARY)"),
            _ => sql.to_owned(),
        }
    }

    /// The places of `key` in `dlock_waiters` (live or lapsed) whose `Locker` is `owner`:
    /// how many still wait (no release granted them anything), and how many a release
    /// marked granted.
    fn places_of(&self, key: &str, owner: &str) -> (i64, i64) {
        let sql = self.sql(
            "SELECT CAST(COUNT(CASE WHEN granted_at IS NULL THEN 1 END) AS BIGINT) AS waiting, \
                    CAST(COUNT(granted_at) AS BIGINT) AS granted \
             FROM dlock_waiters WHERE lock_key = ? AND owner = ?",
        );
        // MySQL casts to SIGNED, not BIGINT.
        let sql = if self.backend == "mysql" {
            sql.replace("AS BIGINT)", "AS SIGNED)")
        } else {
            sql
        };
        let mut c = self.admin.get().unwrap();
        let r = diesel::sql_query(sql)
            .bind::<diesel::sql_types::Text, _>(key)
            .bind::<diesel::sql_types::Text, _>(owner)
            .get_result::<Counts>(&mut *c)
            .unwrap();
        (r.waiting, r.granted)
    }

    /// Every place of `key` in `dlock_waiters`, live, lapsed or granted.
    fn places(&self, key: &str) -> i64 {
        #[derive(diesel::QueryableByName)]
        struct N {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            n: i64,
        }
        let sql = self.sql("SELECT COUNT(*) AS n FROM dlock_waiters WHERE lock_key = ?");
        let sql = if self.backend == "mysql" {
            sql.replace("COUNT(*)", "CAST(COUNT(*) AS SIGNED)")
        } else {
            sql
        };
        let mut c = self.admin.get().unwrap();
        diesel::sql_query(sql)
            .bind::<diesel::sql_types::Text, _>(key)
            .get_result::<N>(&mut *c)
            .unwrap()
            .n
    }

    /// Waits (at most `BOUND`) until `owner`'s waiter has its place in `key`'s line, not
    /// granted.
    fn until_in_line(&self, key: &str, owner: &str) {
        let start = Instant::now();
        loop {
            let p = self.places_of(key, owner);
            if p == (1, 0) {
                return;
            }
            assert!(
                start.elapsed() < BOUND,
                "{}: {owner}'s places in {key}'s line (waiting, granted): {p:?}, not (1, 0)",
                self.backend
            );
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Who holds `key`'s exclusive lock of `kind`, as `admin` reads it.
    fn holder(&self, key: &str, kind: StrategyKind) -> Option<String> {
        let mut c = self.admin.get().unwrap();
        admin::lock_info(&mut *c, key)
            .unwrap()
            .into_iter()
            .find(|i| i.strategy == kind && i.mode == diesel_lock::LockMode::Exclusive)
            .map(|i| i.owner)
    }

    /// A thread that waits for `key` with a `Locker` of strategy `s` owned by `owner`
    /// (`permit`: one of `PERMITS`, else the exclusive lock), says when it has it, and holds
    /// it until told.
    fn waiter(&self, key: &str, s: &str, owner: &str, permit: bool) -> Waiter {
        let l = self.locker(s, owner);
        let (key, name) = (key.to_owned(), format!("{} {owner}", self.backend));
        let (got_tx, got) = channel();
        let (done, done_rx) = channel::<()>();
        let thread = {
            let name = name.clone();
            std::thread::spawn(move || {
                let g = if permit {
                    l.try_permit_for(&key, PERMITS, WAIT)
                } else {
                    l.try_lock_for(&key, WAIT)
                };
                let g = g
                    .unwrap_or_else(|e| panic!("{name}: {e}"))
                    .unwrap_or_else(|| panic!("{name}: not served within {WAIT:?}"));
                let _ = got_tx.send(g.token());
                let _ = done_rx.recv();
                g.release()
                    .unwrap_or_else(|e| panic!("{name}: release: {e}"));
            })
        };
        Waiter {
            name,
            got,
            done,
            thread,
        }
    }
}

/// A waiting thread (`Db::waiter`).
struct Waiter {
    name: String,
    got: Receiver<i64>,
    done: Sender<()>,
    thread: JoinHandle<()>,
}

impl Waiter {
    /// Its token, once it holds the lock (at most `BOUND` from now).
    fn got(&self) -> i64 {
        self.got
            .recv_timeout(BOUND)
            .unwrap_or_else(|e| panic!("{}: not served within {BOUND:?} ({e})", self.name))
    }

    /// Releases its lock and ends the thread.
    fn finish(self) {
        let _ = self.done.send(());
        if let Err(e) = self.thread.join() {
            std::panic::resume_unwind(e);
        }
    }
}

/// `l`'s `try_lock` (or `try_permit`), which must get the key at once: what another lock's
/// line must not hold up.
fn must_get(
    backend: &str,
    l: &Locker<AnyConnection>,
    key: &str,
    permit: bool,
    why: &str,
) -> LockGuard<AnyConnection> {
    let g = if permit {
        l.try_permit(key, PERMITS)
    } else {
        l.try_lock(key)
    };
    let what = if permit { "try_permit" } else { "try_lock" };
    g.unwrap_or_else(|e| panic!("{backend}: {} {what}: {e}", l.owner()))
        .unwrap_or_else(|| {
            panic!(
                "{backend}: {} {what} of {key} was refused, though its lock is free: {why}",
                l.owner()
            )
        })
}

/// The lock that `s` (`"row"` or `"lease"`) names.
fn kind(s: &str) -> StrategyKind {
    match s {
        "row" => StrategyKind::Row,
        "lease" => StrategyKind::Lease,
        other => panic!("no such lock in these tests: {other}"),
    }
}

/// A `Row` holder keeps "k" and a `Row` waiter waits in line for it. The key's `Lease` is
/// another lock, free: a `Lease` newcomer's `try_lock` gets it at once (no `Row` place is
/// ahead of it in the lease's line). Its release then hands the `Row` waiter nothing: the
/// lease is free again and the waiter's place not granted. The `Row` waiter is served as
/// the row is released, and no place is left. (The key is new, so the lease's acquisition
/// is the one that inserts its row and looks into the line: a lease row that a release had
/// marked `line_free` is taken without a look, as a `Row` place does not clear the mark.)
/// The mirror (`lined` "lease", `newcomer` "row") likewise.
fn a_newcomer_is_not_held_behind_another_locks_line(
    backend: &'static str,
    lined: &str,
    newcomer: &str,
) {
    let Some(db) = db(backend) else {
        return;
    };
    let key = common::unique_key(&format!("scopes-{newcomer}-behind-{lined}"));
    let (holder, waiter, new) = (
        format!("{lined}-holder"),
        format!("{lined}-waiter"),
        format!("{newcomer}-newcomer"),
    );
    let held = must_get(
        backend,
        &db.locker(lined, &holder),
        &key,
        false,
        "fresh key",
    );
    let b = db.waiter(&key, lined, &waiter, false);
    db.until_in_line(&key, &waiter);

    let g = must_get(
        backend,
        &db.locker(newcomer, &new),
        &key,
        false,
        &format!("a {lined} waiter's place in its lock's line held up the {newcomer} lock"),
    );
    assert_eq!(db.holder(&key, kind(newcomer)), Some(new));
    g.release().unwrap();
    assert_eq!(
        db.holder(&key, kind(newcomer)),
        None,
        "{backend}: the {newcomer}'s release handed it on (to the {lined} waiter's place)"
    );
    assert_eq!(
        db.places_of(&key, &waiter),
        (1, 0),
        "{backend}: {waiter}'s place (waiting, granted) after the {newcomer}'s release"
    );
    assert_eq!(db.holder(&key, kind(lined)), Some(holder));

    let first = held.token();
    held.release().unwrap();
    let token = b.got();
    assert!(
        token > first,
        "{backend}: {waiter}'s token {token} after {first}"
    );
    b.finish();
    assert_eq!(db.places(&key), 0, "{backend}: places left in the line");
}

/// A `Lease` semaphore's permit waiter (a shared place of the lease's line) holds up no
/// `Row` newcomer: the key's row is another lock.
fn a_row_newcomer_is_not_held_behind_lease_permits(backend: &'static str) {
    let Some(db) = db(backend) else {
        return;
    };
    let key = common::unique_key("scopes-row-behind-lease-permits");
    let held = must_get(
        backend,
        &db.locker("lease", "permit-h"),
        &key,
        true,
        "fresh key",
    );
    let p = db.waiter(&key, "lease", "permit-p", true);
    db.until_in_line(&key, "permit-p");

    let g = must_get(
        backend,
        &db.locker("row", "row-newcomer"),
        &key,
        false,
        "a Lease permit waiter's place in the lease's line held up the Row lock",
    );
    g.release().unwrap();
    assert_eq!(db.places_of(&key, "permit-p"), (1, 0));

    held.release().unwrap();
    p.got();
    p.finish();
    assert_eq!(db.places(&key), 0, "{backend}: places left in the line");
}

/// `first` and `second` are `"row"` and `"lease"` in either order. A holder of each keeps
/// "k"; a waiter of `first` joins its line first, then a waiter of `second`. The `second`
/// lock's release hands it to its own waiter, the first place of its own line: as the
/// release returns, `admin` names that waiter the holder, and the `first` waiter's place is
/// not granted. (Before, a `Lease` release gave the lease to the `Row` waiter's place, the
/// first of the key's name, which cannot confirm a lease: the `Lease` waiter got it once
/// that grant lapsed, some 1.4 s late; a `Row` release gave the row to the `Lease` waiter's
/// place, which then lost its turn in the lease's line.) The `first` waiter is served as
/// its own lock's holder releases; no place is left.
fn a_release_does_not_grant_another_locks_place(backend: &'static str, first: &str, second: &str) {
    let Some(db) = db(backend) else {
        return;
    };
    let key = common::unique_key(&format!("scopes-{second}-release"));
    let names = |s: &str| (format!("{s}-holder"), format!("{s}-waiter"));
    let ((first_holder, first_waiter), (second_holder, second_waiter)) =
        (names(first), names(second));
    let h1 = must_get(
        backend,
        &db.locker(first, &first_holder),
        &key,
        false,
        "fresh key",
    );
    let h2 = must_get(
        backend,
        &db.locker(second, &second_holder),
        &key,
        false,
        "fresh key",
    );
    let w1 = db.waiter(&key, first, &first_waiter, false);
    db.until_in_line(&key, &first_waiter);
    let w2 = db.waiter(&key, second, &second_waiter, false);
    db.until_in_line(&key, &second_waiter);

    let before = h2.token();
    h2.release().unwrap();
    let given = db.holder(&key, kind(second));
    let first_place = db.places_of(&key, &first_waiter);
    assert_eq!(
        given.as_deref(),
        Some(second_waiter.as_str()),
        "{backend}: the {second}'s release gave it to {given:?}, not to the first place of \
         its own line ({first_waiter}'s place, waiting/granted: {first_place:?})"
    );
    assert_eq!(
        first_place,
        (1, 0),
        "{backend}: {first_waiter}'s place (waiting, granted) after the {second}'s release"
    );
    let token = w2.got();
    assert!(
        token > before,
        "{backend}: {second_waiter}'s token {token} after {before}"
    );
    assert_eq!(db.holder(&key, kind(first)), Some(first_holder));

    let before = h1.token();
    h1.release().unwrap();
    assert_eq!(db.holder(&key, kind(first)), Some(first_waiter.clone()));
    let token = w1.got();
    assert!(
        token > before,
        "{backend}: {first_waiter}'s token {token} after {before}"
    );
    w2.finish();
    w1.finish();
    assert_eq!(db.places(&key), 0, "{backend}: places left in the line");
}

/// The other session strategy's permits, which are other locks than `s`'s of the same name
/// (PostgreSQL; MySQL has no `Advisory` permits).
fn other_permits(backend: &str, s: &str) -> Option<&'static str> {
    match (backend, s) {
        ("pg", "for_update") => Some("advisory"),
        ("pg", "advisory") => Some("for_update"),
        _ => None,
    }
}

/// A permit holder of strategy `s` (`ForUpdate`, `Advisory`) takes the one permit of "k",
/// and a permit waiter of `s` waits in its line. None of the locks of that name in other
/// lines is held up: the key's `Row` lock, its `Lease` (exclusive, and a `Lease` permit),
/// and the permits of the other session strategy. The waiter is then served as the holder
/// releases; no place is left.
fn permit_waiters_hold_up_no_other_lock(backend: &'static str, s: &str) {
    let Some(db) = db(backend) else {
        return;
    };
    let key = common::unique_key(&format!("scopes-permits-{s}"));
    let held = must_get(backend, &db.locker(s, "permit-h"), &key, true, "fresh key");
    let p = db.waiter(&key, s, "permit-p", true);
    db.until_in_line(&key, "permit-p");

    let why = format!("a {s} permit waiter's place held it up");
    let row = must_get(backend, &db.locker("row", "row-n"), &key, false, &why);
    row.release().unwrap();
    let lease = must_get(backend, &db.locker("lease", "lease-n"), &key, false, &why);
    lease.release().unwrap();
    let permit = must_get(backend, &db.locker("lease", "lease-p"), &key, true, &why);
    permit.release().unwrap();
    if let Some(other) = other_permits(backend, s) {
        let permit = must_get(backend, &db.locker(other, "other-p"), &key, true, &why);
        permit.release().unwrap();
    }
    assert_eq!(db.places_of(&key, "permit-p"), (1, 0));

    held.release().unwrap();
    p.got();
    p.finish();
    assert_eq!(db.places(&key), 0, "{backend}: places left in the line");
}

/// The reverse: a `Row` waiter in the line of "k"'s row (behind its holder), then a
/// `Lease` waiter in the line of its lease too, hold up no permit of `s` (`ForUpdate`,
/// `Advisory`) of that name: its `try_permit` is let in at once each time, the key's
/// permits being all free. The waiters are served as their holders release.
fn permits_are_not_held_up_by_other_lines(backend: &'static str, s: &str) {
    let Some(db) = db(backend) else {
        return;
    };
    let key = common::unique_key(&format!("scopes-other-lines-{s}"));
    let permits = db.locker(s, "permit-n");

    let r = must_get(
        backend,
        &db.locker("row", "row-r"),
        &key,
        false,
        "fresh key",
    );
    let b = db.waiter(&key, "row", "row-b", false);
    db.until_in_line(&key, "row-b");
    let g = must_get(
        backend,
        &permits,
        &key,
        true,
        "a Row waiter's place held the permit up",
    );
    g.release().unwrap();

    let l = must_get(
        backend,
        &db.locker("lease", "lease-l"),
        &key,
        false,
        "fresh key",
    );
    let w = db.waiter(&key, "lease", "lease-w", false);
    db.until_in_line(&key, "lease-w");
    let g = must_get(
        backend,
        &permits,
        &key,
        true,
        "a Lease waiter's place (or a Row waiter's) held the permit up",
    );
    g.release().unwrap();

    r.release().unwrap();
    b.got();
    l.release().unwrap();
    w.got();
    b.finish();
    w.finish();
    assert_eq!(db.places(&key), 0, "{backend}: places left in the line");
}

macro_rules! scope_suite {
    ($($name:ident: $backend:literal;)+) => {$(
        mod $name {
            #[test]
            fn a_lease_newcomer_is_not_held_behind_a_row_line() {
                super::a_newcomer_is_not_held_behind_another_locks_line($backend, "row", "lease");
            }
            #[test]
            fn a_row_newcomer_is_not_held_behind_a_lease_line() {
                super::a_newcomer_is_not_held_behind_another_locks_line($backend, "lease", "row");
            }
            #[test]
            fn a_row_newcomer_is_not_held_behind_lease_permits() {
                super::a_row_newcomer_is_not_held_behind_lease_permits($backend);
            }
            #[test]
            fn a_lease_release_does_not_grant_a_row_place() {
                super::a_release_does_not_grant_another_locks_place($backend, "row", "lease");
            }
            #[test]
            fn a_row_release_does_not_grant_a_lease_place() {
                super::a_release_does_not_grant_another_locks_place($backend, "lease", "row");
            }
        }
    )+};
}

scope_suite! {
    sqlite: "sqlite";
    pg: "pg";
    pgbouncer: "pgbouncer";
    mysql: "mysql";
}

macro_rules! permit_scope_suite {
    ($($name:ident: $backend:literal, $strategy:literal;)+) => {$(
        mod $name {
            #[test]
            fn permit_waiters_hold_up_no_other_lock() {
                super::permit_waiters_hold_up_no_other_lock($backend, $strategy);
            }
            #[test]
            fn permits_are_not_held_up_by_other_lines() {
                super::permits_are_not_held_up_by_other_lines($backend, $strategy);
            }
        }
    )+};
}

permit_scope_suite! {
    pg_for_update: "pg", "for_update";
    pg_advisory: "pg", "advisory";
    pgbouncer_for_update: "pgbouncer", "for_update";
    mysql_for_update: "mysql", "for_update";
}
