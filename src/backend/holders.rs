//! Readers and semaphore permits of `Strategy::Lease` (`strategy/lease/holders.rs`): what an
//! acquisition decides, written once, over the few statements each backend writes its own
//! way (`HolderSteps`, in `{pg,mysql,sqlite}/holders.rs`).
//!
//! One lock per key: the key's lease row in `dlock_leases` (the exclusive lease, which is
//! also the writer) serialises everything. Its `shared_until` is the latest expiry of the
//! key's live readers and permits, and its `token` is the key's one token counter. A shared
//! acquisition is one short transaction that locks the lease row first (PostgreSQL and
//! MySQL: `SELECT … FOR UPDATE`; SQLite: an IMMEDIATE transaction, its single writer), is
//! busy while an exclusive lease is live or an exclusive waiter has a live place ahead in
//! the key's line (`dlock_waiters`: writers do not starve; a permit also while the live
//! places ahead of its own, all of them for a newcomer, fill the free permits: first come,
//! first served), locks the key's header row in
//! `dlock_shared_keys` (its kind: `permit_count`, 0 for a reader-writer key, N for a semaphore),
//! counts, inserts its holder row in `dlock_shared_leases` with the next token and raises
//! `shared_until` to its own expiry. The exclusive acquire takes the lease row only once
//! `shared_until` has passed; the row is the one it updates, so it reads the newest value
//! after any wait for the row's lock. Renewals raise `shared_until` in the same statement
//! or transaction; a release deletes its holder row and, with the lease row locked (so it
//! sees every committed holder), lowers `shared_until` to the latest expiry of the others.
//!
//! The acquiring transaction holds the lease row and the header locked for a few statements,
//! and so would hold every renewal, release and acquisition of the key for as long as its
//! client stops between two of them (a process stopped by SIGSTOP or a debugger, a hung
//! thread, a network partition). The server bounds it: the transaction may sit idle at most
//! `stall_bound` (a quarter of the lease ttl, at most `STALL_CAP`), after which the server
//! ends the session and its locks go (PostgreSQL `idle_in_transaction_session_timeout`,
//! MariaDB `idle_transaction_timeout`), well before the holders' renewals, retried every
//! heartbeat, give up; and it waits for a row lock at most `ROW_WAIT` (`lock_timeout`,
//! `innodb_lock_wait_timeout`: busy, and the waiting loop goes on to its deadline). A
//! release's transaction is bounded the same way (`STALL_CAP`). A release whose own holder
//! row another session holds (a purge's, a stopped client's) does not wait for it with the
//! lease row locked: it lets the lease row go, waits for its row alone, and tries again
//! (`release_with`).

use super::Acquired;
use diesel::QueryResult;
use std::time::Duration;

/// The longest any transaction of the holders may sit idle between its statements before
/// the server ends it (whole seconds on MariaDB).
#[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
pub(crate) const STALL_CAP: Duration = Duration::from_secs(2);

/// The shortest idle bound, whatever the ttl: a client on a loaded machine may pause this
/// long between two statements without losing its session (the least MariaDB takes, too).
/// The holders' renewals outlast it with a ttl of 2 s or more.
#[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
const STALL_FLOOR: Duration = Duration::from_secs(1);

/// How long one acquisition waits for a row lock of the key before it counts as busy (whole
/// seconds on MariaDB, where 1 is the least). A newcomer queued behind a stopped
/// transaction thus returns to its waiting loop, which keeps its own deadline.
#[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
pub(crate) const ROW_WAIT: Duration = Duration::from_secs(1);

/// How long an acquiring transaction of a lease of `ttl_us` may sit idle: a quarter of the
/// ttl (the holders' renewals, every third of theirs, then still have most of their lease
/// to get through), between `STALL_FLOOR` and `STALL_CAP`.
#[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
pub(crate) fn stall_bound(ttl_us: i64) -> Duration {
    Duration::from_micros(u64::try_from(ttl_us).unwrap_or(0) / 4).clamp(STALL_FLOOR, STALL_CAP)
}

/// A holder's mode, as stored in `dlock_shared_leases.mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HolderMode {
    /// One of many readers.
    Read,
    /// One of at most `permits` holders of a semaphore.
    Permit,
}

impl HolderMode {
    pub fn as_str(self) -> &'static str {
        match self {
            HolderMode::Read => "read",
            HolderMode::Permit => "permit",
        }
    }
}

/// One acquisition attempt.
#[derive(Debug, Clone, Copy)]
pub struct HolderAsk<'a> {
    pub key: &'a str,
    pub owner: &'a str,
    /// Unique per acquisition: releases and renewals go by it.
    pub holder: &'a str,
    pub mode: HolderMode,
    /// 0 for a reader-writer key (`Read`), N for a semaphore (`Permit`).
    pub permits: i64,
    pub ttl_us: i64,
    /// The caller's place in the key's line, or `NO_PLACE` (a newcomer).
    pub place: i64,
}

/// What an attempt found.
#[derive(Debug, Clone, Copy)]
pub enum HolderAnswer {
    Taken(Acquired),
    Busy,
    /// The key is stored with another number of permits (0: a reader-writer key).
    Mismatch {
        stored: i64,
    },
}

/// The statements of readers and semaphore permits (`strategy/lease/holders.rs`), on every
/// backend. Durations are whole microseconds.
pub trait HolderLocks {
    /// One attempt, in one transaction (see the module's documentation).
    fn holders_acquire(&mut self, ask: &HolderAsk<'_>) -> QueryResult<HolderAnswer>;
    /// Extends an unexpired holder row of `holder` and raises the key's `shared_until` with
    /// it, atomically; false if there is none. Waits for a row lock at most about `bound`,
    /// as `Locks::lease_renew` does.
    fn holders_renew(
        &mut self,
        key: &str,
        holder: &str,
        ttl_us: i64,
        bound: std::time::Duration,
    ) -> QueryResult<bool>;
    /// Renews many holders (`holders`: keys and their holder ids, at most 500) at once, each
    /// as `holders_renew` would, except that a holder whose key's lease row, or whose own
    /// row, another session has locked is skipped, never waited for (PostgreSQL, MySQL:
    /// `FOR UPDATE SKIP LOCKED`; SQLite has one writer, waited for as long as its
    /// `busy_timeout`). Returns the holder ids renewed; the caller renews the others one by
    /// one, which tells a lost holder from a stuck one.
    fn holders_renew_many(
        &mut self,
        holders: &[(String, String)],
        ttl_us: i64,
    ) -> QueryResult<Vec<String>>;
    /// Deletes `holder`'s row and lowers the key's `shared_until` to the latest expiry of its
    /// other live holders; false if the row was gone. If another session holds the row, it
    /// is waited for without the key's lease row (`release_with`).
    fn holders_release(&mut self, key: &str, holder: &str) -> QueryResult<bool>;
    /// Is `holder`'s row there and unexpired?
    fn holders_held(&mut self, key: &str, holder: &str) -> QueryResult<bool>;
    /// The live holders, of every key or of one, ordered by key, with their modes.
    fn admin_holders(&mut self, key: Option<&str>) -> QueryResult<Vec<HolderRow>>;
    /// `Locker::purge` of a `Lease` `Locker`: deletes the holder rows (readers, permits, and
    /// writers left by versions before migration 12) expired `idle_us` ago or longer, which only a later acquisition of the same
    /// key would delete otherwise. The keys' header rows stay: they carry the keys' kinds.
    fn holders_purge(&mut self, idle_us: i64) -> QueryResult<usize>;
}

/// Shared session locks: PostgreSQL's `pg_advisory_lock_shared` family, the readers of an
/// `Advisory` `Locker` (its writers are its ordinary advisory locks, which conflict with
/// them on the same key). Tokens as `SessionLocks::advisory_lock` draws them.
pub trait SharedSessionLocks {
    /// Takes a shared hold, waiting as `wait` says; `Ok(None)`: busy, and not held (a grant
    /// that raced a timeout is undone). After an `Err` the session may hold it: the caller
    /// discards the connection.
    fn advisory_lock_shared(
        &mut self,
        key: &str,
        wait: super::Wait,
    ) -> QueryResult<Option<Acquired>>;
    /// Releases one shared hold; false if the session had none.
    fn advisory_unlock_shared(&mut self, key: &str) -> QueryResult<bool>;
    /// Does this session hold the key shared?
    fn advisory_held_shared(&mut self, key: &str) -> QueryResult<bool>;
    /// How many of `keys` some session of this database holds an advisory lock on (a read
    /// of `pg_locks`: it takes nothing, and waits for nobody). `Advisory` permits count
    /// their semaphore's taken slots so.
    fn advisory_held_anywhere(&mut self, keys: &[String]) -> QueryResult<i64>;
}

/// A live holder as `admin_holders` reads it.
#[derive(Debug, Clone)]
pub struct HolderRow {
    /// What `admin` shows.
    pub info: crate::LockInfo,
    /// `"read"`, `"write"` or `"permit"`.
    pub mode: String,
    /// The key's permits (0: a reader-writer key).
    pub permits: i64,
    /// The holder id (what a forced release deletes by).
    pub holder: String,
}

/// How many times an acquisition creates the key's lease row again after a purge deleted
/// it between the creation and the transaction (each time a purge must have won that race).
const CREATE_TRIES: usize = 100;

/// Runs an acquisition's transaction, creating the key's lease row and header first if
/// it has none (again if a concurrent purge deleted the free lease row in between).
pub(crate) fn acquire_with<C: HolderSteps>(
    conn: &mut C,
    ask: &HolderAsk<'_>,
    mut transaction: impl FnMut(&mut C, &HolderAsk<'_>) -> QueryResult<Option<HolderAnswer>>,
) -> QueryResult<HolderAnswer> {
    if let Some(answer) = transaction(conn, ask)? {
        return Ok(answer);
    }
    for _ in 0..CREATE_TRIES {
        conn.create_lease(ask.key)?;
        conn.create_header(ask.key, ask.permits)?;
        if let Some(answer) = transaction(conn, ask)? {
            return Ok(answer);
        }
    }
    Err(diesel::result::Error::QueryBuilderError(
        "the lock's lease or header row vanished".into(),
    ))
}

/// What one try of a release found (`release_with`).
#[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
pub(crate) enum Release {
    /// Done: true if the holder's row was deleted, false if it was gone.
    Done(bool),
    /// The holder's row is there, and another session holds it: nothing was changed.
    Held,
}

/// A release of a holder (`HolderLocks::holders_release`): `once` locks the key's lease row,
/// then deletes the holder's row unless another session holds it (`SKIP LOCKED`), in one
/// transaction; for a held row, `wait` waits for it alone in a transaction of its own (the
/// lease row free: the key's acquisitions and renewals go on) and lets it go, and `once`
/// runs again. A release waited for its row with the lease row locked, for as long as the
/// other session held the row: every acquisition of the key was busy meanwhile, and its
/// readers, whose renewals lock the lease row first, lost their leases (`tests/purge.rs`).
#[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
pub(crate) fn release_with<C>(
    conn: &mut C,
    key: &str,
    mut once: impl FnMut(&mut C) -> QueryResult<Release>,
    mut wait: impl FnMut(&mut C) -> QueryResult<()>,
) -> QueryResult<bool> {
    loop {
        match once(conn)? {
            Release::Done(released) => return Ok(released),
            Release::Held => {
                log::debug!(
                    "lock {key:?}: a release waits for its holder row, held by another session"
                );
                wait(conn)?;
            }
        }
    }
}

/// The key's header row, locked for the rest of the transaction.
#[derive(Debug, Clone)]
pub(crate) struct Header {
    pub(crate) permits: i64,
}

/// The statements of an acquisition, per backend. All but `create_lease` and
/// `create_header` run inside the transaction that `HolderLocks::holders_acquire` opens, in
/// this order: the lease row is locked first, by every statement that writes the key's
/// holders, so that none waits for another in the opposite order.
pub(crate) trait HolderSteps: super::sealed::Lines {
    /// Outside any transaction, committed at once: creates the key's lease row, free, with
    /// the token counter a purge saved for the key (if any), if it has none.
    fn create_lease(&mut self, key: &str) -> QueryResult<()>;
    /// Outside any transaction, committed at once: creates the key's header row with
    /// `permits`, if it has none.
    fn create_header(&mut self, key: &str, permits: i64) -> QueryResult<()>;
    /// Locks the key's lease row: whether a live exclusive lease is on it; `None` if the
    /// key has no lease row yet.
    fn lock_lease(&mut self, key: &str) -> QueryResult<Option<bool>>;
    /// Locks the key's header row; `None` if it has none yet.
    fn lock_header(&mut self, key: &str) -> QueryResult<Option<Header>>;
    /// Deletes the key's expired holders that no other session holds (PostgreSQL, MySQL:
    /// `SKIP LOCKED`), never waiting for one: this transaction holds the key's lease row, and
    /// the key's live holders' renewals wait for it (a wait of `ROW_WAIT` for a purge's or a
    /// stopped client's row cost 2 s readers their leases).
    fn expire(&mut self, key: &str) -> QueryResult<()>;
    /// The key's holders: all of them, and the writers among them (left by versions before
    /// migration 12, whose writers were holders). An expired row that `expire` left, because
    /// another session holds it, is counted, not waited for: a renewal that began before
    /// its expiry and waited for that session may still extend it (its statement's clock is
    /// read before the wait), so until it is deleted it keeps its permit (an adversary's
    /// finding: a semaphore of 1 with two live rows in the database, where it was not).
    fn count(&mut self, key: &str) -> QueryResult<(i64, i64)>;
    /// Draws the key's next token from its lease row, raises the row's `shared_until` to
    /// the holder's expiry and inserts the holder's row with that token.
    fn insert(&mut self, ask: &HolderAsk<'_>) -> QueryResult<Acquired>;
}

/// Inside the transaction: the decision. `None`: the key has no lease or header row yet
/// (the caller rolls back, creates them and tries again).
pub(crate) fn decide(
    steps: &mut dyn HolderSteps,
    ask: &HolderAsk<'_>,
) -> QueryResult<Option<HolderAnswer>> {
    let Some(exclusive) = steps.lock_lease(ask.key)? else {
        return Ok(None);
    };
    let Some(header) = steps.lock_header(ask.key)? else {
        return Ok(None);
    };
    #[cfg(feature = "test-hooks")]
    crate::hooks::in_holders_acquire(ask.key);
    if header.permits != ask.permits {
        return Ok(Some(HolderAnswer::Mismatch {
            stored: header.permits,
        }));
    }
    // An exclusive holder, or an exclusive waiter's place ahead in the key's line (which
    // new readers and permits must not overtake), makes the key busy. (A newcomer's place is
    // `NO_PLACE`: every live place is ahead of it.)
    let line = steps.line_ahead(ask.key, super::Line::Lease, ask.place)?;
    if exclusive || line.exclusive > 0 {
        return Ok(Some(HolderAnswer::Busy));
    }
    steps.expire(ask.key)?;
    let (total, writers) = steps.count(ask.key)?;
    let free = match ask.mode {
        // The places ahead (permits waiting, all of them) go first: room for them and this.
        HolderMode::Permit => total + line.ahead < ask.permits,
        // Readers ahead do not keep a reader out.
        HolderMode::Read => writers == 0,
    };
    if !free {
        return Ok(Some(HolderAnswer::Busy));
    }
    let taken = steps.insert(ask)?;
    // A waiter's place goes with its acquisition, in the same transaction (on PostgreSQL
    // this notifies the next live place, which may have room now too).
    if ask.place != super::NO_PLACE {
        steps.line_leave(ask.key, super::Line::Lease, ask.place)?;
    }
    Ok(Some(HolderAnswer::Taken(taken)))
}

/// The row each backend's `admin_holders` reads and its conversion to `HolderRow`, written
/// once: backends differ only in their SQL time type and in how its value becomes UTC.
macro_rules! holder_row {
    ($time_sql:ty, $time:ty, $utc:expr) => {
        #[derive(diesel::QueryableByName)]
        struct HolderDbRow {
            #[diesel(sql_type = diesel::sql_types::Text)]
            lock_key: String,
            #[diesel(sql_type = diesel::sql_types::Text)]
            holder: String,
            #[diesel(sql_type = diesel::sql_types::Text)]
            owner: String,
            #[diesel(sql_type = diesel::sql_types::Text)]
            mode: String,
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            permits: i64,
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            token: i64,
            #[diesel(sql_type = $time_sql)]
            acquired_at: $time,
            #[diesel(sql_type = $time_sql)]
            expires_at: $time,
            #[diesel(sql_type = $time_sql)]
            observed_at: $time,
        }

        fn holder_rows(
            rows: diesel::QueryResult<Vec<HolderDbRow>>,
        ) -> diesel::QueryResult<Vec<$crate::backend::holders::HolderRow>> {
            let utc: fn($time) -> chrono::DateTime<chrono::Utc> = $utc;
            rows.map(|v| {
                v.into_iter()
                    .map(|r| $crate::backend::holders::HolderRow {
                        info: $crate::lock_info::LockInfo {
                            key: r.lock_key,
                            strategy: $crate::lock_info::StrategyKind::Lease,
                            owner: r.owner,
                            token: r.token,
                            acquired_at: utc(r.acquired_at),
                            expires_at: Some(utc(r.expires_at)),
                            observed_at: utc(r.observed_at),
                            mode: match r.mode.as_str() {
                                "read" => $crate::lock_info::LockMode::Read,
                                // An older version's writer (before migration 12).
                                "write" => $crate::lock_info::LockMode::Exclusive,
                                _ => $crate::lock_info::LockMode::Permit,
                            },
                            permits: (r.permits > 0)
                                .then(|| u32::try_from(r.permits).unwrap_or(u32::MAX)),
                            waiting: 0,
                            longest_wait: None,
                        },
                        mode: r.mode,
                        permits: r.permits,
                        holder: r.holder,
                    })
                    .collect()
            })
        }
    };
}
pub(crate) use holder_row;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stall_bound_is_a_quarter_of_the_ttl_between_its_floor_and_cap() {
        let us = |d: Duration| i64::try_from(d.as_micros()).unwrap();
        assert_eq!(
            stall_bound(us(Duration::from_secs(4))),
            Duration::from_secs(1)
        );
        assert_eq!(stall_bound(us(Duration::from_secs(8))), STALL_CAP);
        assert_eq!(stall_bound(us(Duration::from_secs(3600))), STALL_CAP);
        assert_eq!(stall_bound(us(Duration::from_millis(10))), STALL_FLOOR);
        assert_eq!(stall_bound(0), STALL_FLOOR);
        assert_eq!(stall_bound(-1), STALL_FLOOR);
        // Below what the holders' renewals (every third of the ttl) can wait out.
        for ttl in [3, 8, 30, 600] {
            let ttl = Duration::from_secs(ttl);
            assert!(stall_bound(us(ttl)) < ttl / 2, "{ttl:?}");
        }
        assert_eq!(stall_bound(us(Duration::from_secs(2))), STALL_FLOOR);
    }
}
