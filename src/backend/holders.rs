//! Shared leases and semaphore permits (`strategy/holders.rs`): what an acquisition decides,
//! written once, over the few statements each backend writes its own way (`HolderSteps`, in
//! `{pg,mysql,sqlite}/holders.rs`).
//!
//! Two tables (migration 8): `dlock_shared_keys`, one header row per key, kept forever (the
//! key's kind, `permits`: 0 for a reader-writer key, N for a semaphore; its token counter;
//! a waiting writer's intent), and `dlock_shared_leases`, one row per holder with its mode,
//! token and expiry on the database clock. An acquisition is one short transaction that
//! locks the key's header row first, so acquisitions of one key run one at a time on every
//! backend (PostgreSQL and MySQL: `SELECT … FOR UPDATE`; SQLite: an IMMEDIATE transaction,
//! its single writer), and everything it counts stays true until it commits: releases and
//! renewals touch only their own holder row, and can only make the count smaller.

use super::Acquired;
use diesel::QueryResult;

/// A holder's mode, as stored in `dlock_shared_leases.mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HolderMode {
    /// One of many readers.
    Read,
    /// The one writer.
    Write,
    /// One of at most `permits` holders of a semaphore.
    Permit,
}

impl HolderMode {
    pub fn as_str(self) -> &'static str {
        match self {
            HolderMode::Read => "read",
            HolderMode::Write => "write",
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
    /// 0 for a reader-writer key (`Read`, `Write`), N for a semaphore (`Permit`).
    pub permits: i64,
    pub ttl_us: i64,
    /// A writer that will wait if the key is busy: its waiter's id and how long its intent
    /// lasts unless renewed by its next attempt. `None` for one attempt without waiting (a
    /// `try_write` must not hold readers back).
    pub intent: Option<(&'a str, i64)>,
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

/// The statements of shared leases and semaphore permits (`strategy/holders.rs`), on every
/// backend. Durations are whole microseconds.
pub trait HolderLocks {
    /// One attempt, in one transaction (see the module's documentation).
    fn holders_acquire(&mut self, ask: &HolderAsk<'_>) -> QueryResult<HolderAnswer>;
    /// Extends an unexpired holder row of `holder`; false if there is none. Waits for a row
    /// lock at most about `bound`, as `Locks::lease_renew` does.
    fn holders_renew(
        &mut self,
        key: &str,
        holder: &str,
        ttl_us: i64,
        bound: std::time::Duration,
    ) -> QueryResult<bool>;
    /// Deletes `holder`'s row; false if it was gone.
    fn holders_release(&mut self, key: &str, holder: &str) -> QueryResult<bool>;
    /// Is `holder`'s row there and unexpired?
    fn holders_held(&mut self, key: &str, holder: &str) -> QueryResult<bool>;
    /// The live holders, of every key or of one, ordered by key, with their modes.
    fn admin_holders(&mut self, key: Option<&str>) -> QueryResult<Vec<HolderRow>>;
    /// Outside any transaction: clears a writer's intent if it is `who`'s (a writer that
    /// gave up waiting).
    fn holders_clear_intent(&mut self, key: &str, who: &str) -> QueryResult<()>;
    /// `Locker::purge` of a `Lease` `Locker`: deletes the holder rows (readers, writers,
    /// permits) expired `idle_us` ago or longer, which only a later acquisition of the same
    /// key would delete otherwise. The keys' header rows stay: they carry the token counters.
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

/// Runs an acquisition's transaction, creating the key's header first if it has none.
pub(crate) fn acquire_with<C: HolderSteps>(
    conn: &mut C,
    ask: &HolderAsk<'_>,
    mut transaction: impl FnMut(&mut C, &HolderAsk<'_>) -> QueryResult<Option<HolderAnswer>>,
) -> QueryResult<HolderAnswer> {
    if let Some(answer) = transaction(conn, ask)? {
        return Ok(answer);
    }
    conn.create_header(ask.key, ask.permits)?;
    transaction(conn, ask)?.ok_or_else(|| {
        diesel::result::Error::QueryBuilderError("the lock's header row vanished".into())
    })
}

/// The key's header row, locked for the rest of the transaction.
#[derive(Debug, Clone)]
pub(crate) struct Header {
    pub(crate) permits: i64,
    /// The waiting writer's id, if its intent has not run out.
    pub(crate) live_intent: Option<String>,
}

/// The statements of an acquisition, per backend. All but `create_header` run inside the
/// transaction that `HolderLocks::holders_acquire` opens.
pub(crate) trait HolderSteps {
    /// Outside any transaction, committed at once: creates the key's header row with
    /// `permits`, if it has none.
    fn create_header(&mut self, key: &str, permits: i64) -> QueryResult<()>;
    /// Locks the key's header row; `None` if it has none yet.
    fn lock_header(&mut self, key: &str) -> QueryResult<Option<Header>>;
    /// Deletes the key's expired holders.
    fn expire(&mut self, key: &str) -> QueryResult<()>;
    /// The key's live holders: all of them, and the writers among them.
    fn count(&mut self, key: &str) -> QueryResult<(i64, i64)>;
    /// Sets (or renews) a waiting writer's intent for `us` microseconds.
    fn set_intent(&mut self, key: &str, who: &str, us: i64) -> QueryResult<()>;
    /// Clears the intent if it is `who`'s.
    fn clear_intent(&mut self, key: &str, who: &str) -> QueryResult<()>;
    /// Draws the key's next token and inserts the holder's row with it.
    fn insert(&mut self, ask: &HolderAsk<'_>) -> QueryResult<Acquired>;
}

/// Inside the transaction, once the header exists: the decision. `None`: the key has no
/// header row yet (the caller rolls back, creates it and tries again).
pub(crate) fn decide(
    steps: &mut dyn HolderSteps,
    ask: &HolderAsk<'_>,
) -> QueryResult<Option<HolderAnswer>> {
    let Some(header) = steps.lock_header(ask.key)? else {
        return Ok(None);
    };
    if header.permits != ask.permits {
        return Ok(Some(HolderAnswer::Mismatch {
            stored: header.permits,
        }));
    }
    steps.expire(ask.key)?;
    let (total, writers) = steps.count(ask.key)?;
    let mine = |who: &str| ask.intent.is_some_and(|(me, _)| me == who);
    let free = match ask.mode {
        HolderMode::Permit => total < ask.permits,
        // A waiting writer's intent keeps new readers out (see `strategy/holders.rs`).
        HolderMode::Read => writers == 0 && header.live_intent.is_none(),
        HolderMode::Write => total == 0,
    };
    if !free {
        if let (HolderMode::Write, Some((who, us))) = (ask.mode, ask.intent) {
            steps.set_intent(ask.key, who, us)?;
        }
        return Ok(Some(HolderAnswer::Busy));
    }
    if ask.mode == HolderMode::Write && header.live_intent.as_deref().is_some_and(mine) {
        steps.clear_intent(ask.key, ask.intent.map_or("", |(who, _)| who))?;
    }
    Ok(Some(HolderAnswer::Taken(steps.insert(ask)?)))
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
                                "write" => $crate::lock_info::LockMode::Write,
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
