//! What the backends write alike, written once: the rows their acquisitions and admin reads
//! return (`acquired_row!`, `held_row!`, `One`), and the statements whose SQL is the same on several backends, each as one
//! text and one method (`statements!`) that a backend expands inside its trait impl. Every
//! text says which backends run it; a backend whose SQL differs writes its own.
// Its statements' texts are `pub` for `__bench_sql` (feature `bench-sql`) only.
#![cfg_attr(not(feature = "bench-sql"), allow(unreachable_pub))]

// The texts. Those the benches' raw floors run are `pub`, for `diesel_lock::__bench_sql`.

/// `version_read`, on every backend.
pub(crate) const VERSION_READ: &str = "SELECT version FROM dlock_versions WHERE lock_key = ?";

/// `version_bump`, on every backend.
pub(crate) const VERSION_BUMP: &str =
    "UPDATE dlock_versions SET version = version + 1 WHERE lock_key = ? AND version = ?";

/// `version_create` on PostgreSQL and SQLite (MySQL has no `ON CONFLICT`: `INSERT IGNORE`).
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub(crate) const VERSION_CREATE: &str =
    "INSERT INTO dlock_versions (lock_key, version) VALUES (?, 0) \
     ON CONFLICT (lock_key) DO NOTHING";

/// `row_forget` on PostgreSQL and SQLite (MySQL reads the id first, for its lock order).
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub(crate) const ROW_FORGET: &str = "DELETE FROM dlock_rows WHERE lock_key = ? AND holder = ?";

/// `row_release` on MySQL and SQLite (PostgreSQL's also sends `pg_notify`). On PostgreSQL
/// the benches run it as the release without a notification, to measure what that costs.
/// Matched by id and holder id (see `Locks::row_release`).
pub const ROW_RELEASE: &str = "DELETE FROM dlock_rows WHERE id = ? AND COALESCE(holder, '') = ?";

/// `row_give_back`'s read, on every backend: the id of the key's row if `holder` holds it.
pub(crate) const ROW_OF_HOLDER: &str =
    "SELECT id FROM dlock_rows WHERE lock_key = ? AND holder = ?";

/// `row_held`, on every backend. It reads the id itself, a BIGINT on every backend, so that
/// one text serves all three (a literal `1` would need a cast of its own on each).
/// Matched by id and holder id, as `ROW_RELEASE`.
pub(crate) const ROW_HELD: &str =
    "SELECT id FROM dlock_rows WHERE id = ? AND COALESCE(holder, '') = ?";

/// `lease_release` on MySQL and SQLite (PostgreSQL's also sends `pg_notify`). On PostgreSQL
/// the benches run it as the release without a notification, to measure what that costs.
pub const LEASE_RELEASE: &str = "UPDATE dlock_leases SET holder_id = NULL, expires_at = NULL \
     WHERE lock_key = ? AND holder_id = ?";

/// `line_leave` on MySQL and SQLite (PostgreSQL's also notifies the next place), and the
/// removal of a waiter's place after its acquisition there: by the place's number.
#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(crate) const LEAVE_PLACE: &str = "DELETE FROM dlock_waiters WHERE id = ?";

/// `line_leave`'s first step on MySQL: the place goes if no release granted it the key.
#[cfg(feature = "mysql")]
pub(crate) const LEAVE_UNGRANTED: &str =
    "DELETE FROM dlock_waiters WHERE id = ? AND granted_at IS NULL";

/// `HolderSteps::create_header` on PostgreSQL and SQLite (MySQL: `INSERT IGNORE`).
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub(crate) const CREATE_HEADER: &str =
    "INSERT INTO dlock_shared_keys (lock_key, permit_count, token) \
     VALUES (?, ?, 0) ON CONFLICT (lock_key) DO NOTHING";

/// `schema_current`, on every backend: diesel records each applied migration by version.
pub(crate) const SCHEMA_CURRENT: &str = "SELECT version FROM __diesel_schema_migrations";

/// A holder id (a batch renewal's renewed leases).
#[derive(diesel::QueryableByName)]
pub(crate) struct HolderId {
    #[diesel(sql_type = diesel::sql_types::Text)]
    pub(crate) holder_id: String,
}

/// A row with a key and a holder id (a batch renewal's locked rows).
#[derive(diesel::QueryableByName)]
pub(crate) struct KeyHolder {
    #[diesel(sql_type = diesel::sql_types::Text)]
    pub(crate) lock_key: String,
    #[diesel(sql_type = diesel::sql_types::Text)]
    pub(crate) holder_id: String,
}

/// `Admin::purge_boundary`'s text for a table: the key the bound offset places after the key
/// bound first, in the table's key order.
macro_rules! boundary {
    ($table:literal) => {
        concat!(
            "SELECT lock_key FROM ",
            $table,
            " WHERE lock_key > ? ORDER BY lock_key LIMIT 1 OFFSET ?"
        )
    };
}
pub(crate) use boundary;

/// A key read back (`SELECT lock_key …`): where a purge's batch ends.
#[derive(diesel::QueryableByName)]
pub(crate) struct Key {
    #[diesel(sql_type = diesel::sql_types::Text)]
    pub(crate) lock_key: String,
}

/// A one-column answer (`… AS one`): a count, a flag, or only whether there is a row.
#[derive(diesel::QueryableByName)]
pub(crate) struct One {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    #[allow(dead_code)] // SQLite asks only whether there is a row
    pub(crate) one: i64,
}

/// What the line's renewals and looks answer (`Lines::line_renew`, `line_look`): whether the
/// caller's place is there and live (`mine`, 0 or 1; for a renewal, renewed), how many live
/// places are ahead, and the exclusive waiters' among them (`exclusive`), and whether it is
/// live and granted (`granted`, 0 or 1).
#[derive(diesel::QueryableByName)]
pub(crate) struct Mine {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    pub(crate) mine: i64,
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    pub(crate) ahead: i64,
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    pub(crate) exclusive: i64,
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    pub(crate) granted: i64,
    #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::BigInt>)]
    pub(crate) floor: Option<i64>,
}

impl Mine {
    /// Where the caller's place stands, if it is there (a granted place is, renewed or not).
    pub(crate) fn spot(self) -> Option<crate::backend::sealed::Spot> {
        (self.mine == 1 || self.granted == 1).then_some(crate::backend::sealed::Spot {
            ahead: self.ahead,
            exclusive: self.exclusive,
            granted: self.granted == 1,
            floor: self.floor,
            lease: None,
        })
    }
}

/// Whether a query for a `One` found a row.
pub(crate) fn exists(q: diesel::QueryResult<Option<One>>) -> diesel::QueryResult<bool> {
    q.map(|r| r.is_some())
}

/// The row an acquisition returns (`id, token, acquired_at`) and its conversion to
/// `Acquired`, written once: backends differ only in their SQL time type and in how its Rust
/// value becomes UTC.
macro_rules! acquired_row {
    ($time_sql:ty, $time:ty, $utc:expr) => {
        #[derive(diesel::QueryableByName)]
        struct AcquiredRow {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            id: i64,
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            token: i64,
            #[diesel(sql_type = $time_sql)]
            acquired_at: $time,
        }

        impl From<AcquiredRow> for $crate::backend::Acquired {
            fn from(r: AcquiredRow) -> Self {
                let utc: fn($time) -> chrono::DateTime<chrono::Utc> = $utc;
                $crate::backend::Acquired {
                    id: r.id,
                    token: r.token,
                    acquired_at: utc(r.acquired_at),
                }
            }
        }

        /// A look (`Mine`) with the lease a grant gave the place's holder, if it holds one
        /// (`Lines::line_look_lease`).
        #[derive(diesel::QueryableByName)]
        #[allow(dead_code)] // a build without Lease's look (none today) would not read it
        struct LookRow {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            mine: i64,
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            ahead: i64,
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            exclusive: i64,
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            granted: i64,
            #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::BigInt>)]
            floor: Option<i64>,
            #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::BigInt>)]
            token: Option<i64>,
            #[diesel(sql_type = diesel::sql_types::Nullable<$time_sql>)]
            acquired_at: Option<$time>,
        }

        impl LookRow {
            /// Where the place stands, with the lease it was granted (only if granted).
            fn spot(self) -> Option<$crate::backend::sealed::Spot> {
                let utc: fn($time) -> chrono::DateTime<chrono::Utc> = $utc;
                let lease = match (self.granted, self.token, self.acquired_at) {
                    (1, Some(token), Some(at)) => Some($crate::backend::Acquired {
                        id: 0,
                        token,
                        acquired_at: utc(at),
                    }),
                    _ => None,
                };
                $crate::backend::shared::Mine {
                    mine: self.mine,
                    ahead: self.ahead,
                    exclusive: self.exclusive,
                    granted: self.granted,
                    floor: self.floor,
                }
                .spot()
                .map(|s| $crate::backend::sealed::Spot { lease, ..s })
            }
        }
    };
}
pub(crate) use acquired_row;

/// The row every backend's admin queries return (`Admin::admin_rows`/`admin_leases`) and
/// its conversion to `Held`, written once: backends differ only in their SQL time type and in
/// how its Rust value becomes UTC.
macro_rules! held_row {
    ($time_sql:ty, $time:ty, $utc:expr) => {
        #[derive(diesel::QueryableByName)]
        struct HeldRow {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            id: i64,
            #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Text>)]
            holder: Option<String>,
            #[diesel(sql_type = diesel::sql_types::Text)]
            lock_key: String,
            #[diesel(sql_type = diesel::sql_types::Text)]
            owner: String,
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            token: i64,
            #[diesel(sql_type = $time_sql)]
            acquired_at: $time,
            #[diesel(sql_type = diesel::sql_types::Nullable<$time_sql>)]
            expires_at: Option<$time>,
            #[diesel(sql_type = $time_sql)]
            observed_at: $time,
        }

        fn held(
            rows: diesel::QueryResult<Vec<HeldRow>>,
            strategy: $crate::lock_info::StrategyKind,
        ) -> diesel::QueryResult<Vec<$crate::backend::Held>> {
            let utc: fn($time) -> chrono::DateTime<chrono::Utc> = $utc;
            rows.map(|v| {
                v.into_iter()
                    .map(|r| $crate::backend::Held {
                        info: $crate::lock_info::LockInfo {
                            key: r.lock_key,
                            strategy,
                            owner: r.owner,
                            token: r.token,
                            acquired_at: utc(r.acquired_at),
                            expires_at: r.expires_at.map(utc),
                            observed_at: utc(r.observed_at),
                            mode: $crate::lock_info::LockMode::Exclusive,
                            permits: None,
                            waiting: 0,
                            longest_wait: None,
                        },
                        id: r.id,
                        holder: r.holder,
                    })
                    .collect()
            })
        }
    };
}
pub(crate) use held_row;

/// The methods whose SQL and code are the same on the backends that expand them, written
/// once: `statements!(version_read, version_bump)` inside a backend's `impl Admin` defines
/// both there. Each one runs the text of the same name above.
macro_rules! statements {
    (@schema_current) => {
        fn schema_current(&mut self) -> diesel::QueryResult<bool> {
            use diesel::RunQueryDsl as _;
            #[derive(diesel::QueryableByName)]
            struct Version {
                #[diesel(sql_type = diesel::sql_types::Text)]
                version: String,
            }
            // Every embedded migration, not only the newest: one numbered below the newest
            // (16, added after 17) is missing from databases migrated before it existed.
            let embedded: Vec<String> = diesel::migration::MigrationSource::<
                <Self as diesel::Connection>::Backend,
            >::migrations(&MIGRATIONS)
                .map_err(|e| diesel::result::Error::QueryBuilderError(e))?
                .iter()
                .map(|m| m.name().version().to_string())
                .collect();
            match $crate::backend::stmt::stmt($crate::backend::shared::SCHEMA_CURRENT)
                .load::<Version>(self)
            {
                Ok(applied) => {
                    let applied: std::collections::HashSet<String> =
                        applied.into_iter().map(|v| v.version).collect();
                    Ok(embedded.iter().all(|v| applied.contains(v)))
                }
                // Never migrated: diesel's record table is missing too.
                Err(diesel::result::Error::DatabaseError(_, info))
                    if info.message().contains("__diesel_schema_migrations") =>
                {
                    Ok(false)
                }
                Err(e) => Err(e),
            }
        }
    };
    (@version_read) => {
        fn version_read(&mut self, key: &str) -> diesel::QueryResult<Option<i64>> {
            use diesel::{OptionalExtension as _, RunQueryDsl as _};
            #[derive(diesel::QueryableByName)]
            struct Version {
                #[diesel(sql_type = diesel::sql_types::BigInt)]
                version: i64,
            }
            $crate::backend::stmt::stmt($crate::backend::shared::VERSION_READ)
                .bind::<diesel::sql_types::Text, _>(key)
                .get_result::<Version>(self)
                .optional()
                .map(|r| r.map(|v| v.version))
        }
    };
    (@version_bump) => {
        fn version_bump(&mut self, key: &str, seen: i64) -> diesel::QueryResult<bool> {
            use diesel::RunQueryDsl as _;
            // On MySQL diesel sets CLIENT_FOUND_ROWS, so the count is of matched rows there too.
            $crate::backend::stmt::stmt($crate::backend::shared::VERSION_BUMP)
                .bind::<diesel::sql_types::Text, _>(key)
                .bind::<diesel::sql_types::BigInt, _>(seen)
                .execute(self)
                .map(|n| n == 1)
        }
    };
    (@version_create) => {
        fn version_create(&mut self, key: &str) -> diesel::QueryResult<()> {
            use diesel::RunQueryDsl as _;
            $crate::backend::stmt::stmt($crate::backend::shared::VERSION_CREATE)
                .bind::<diesel::sql_types::Text, _>(key)
                .execute(self)
                .map(drop)
        }
    };
    (@row_forget) => {
        fn row_forget(&mut self, key: &str, holder: &str) -> diesel::QueryResult<bool> {
            use diesel::RunQueryDsl as _;
            $crate::backend::stmt::stmt($crate::backend::shared::ROW_FORGET)
                .bind::<diesel::sql_types::Text, _>(key)
                .bind::<diesel::sql_types::Text, _>(holder)
                .execute(self)
                .map(|n| n > 0)
        }
    };
    (@row_release) => {
        fn row_release(&mut self, id: i64, holder: &str) -> diesel::QueryResult<bool> {
            use diesel::RunQueryDsl as _;
            $crate::backend::stmt::stmt($crate::backend::shared::ROW_RELEASE)
                .bind::<diesel::sql_types::BigInt, _>(id)
                .bind::<diesel::sql_types::Text, _>(holder)
                .execute(self)
                .map(|n| n == 1)
        }
    };
    (@row_give_back) => {
        fn row_give_back(&mut self, key: &str, holder: &str) -> diesel::QueryResult<bool> {
            use diesel::{OptionalExtension as _, RunQueryDsl as _};
            #[derive(diesel::QueryableByName)]
            struct Id {
                #[diesel(sql_type = diesel::sql_types::BigInt)]
                id: i64,
            }
            let id = $crate::backend::stmt::stmt($crate::backend::shared::ROW_OF_HOLDER)
                .bind::<diesel::sql_types::Text, _>(key)
                .bind::<diesel::sql_types::Text, _>(holder)
                .get_result::<Id>(self)
                .optional()?;
            match id {
                Some(Id { id }) => self.row_release(id, holder),
                None => Ok(false),
            }
        }
    };
    (@row_held) => {
        fn row_held(&mut self, id: i64, holder: &str) -> diesel::QueryResult<bool> {
            use diesel::{OptionalExtension as _, RunQueryDsl as _};
            #[derive(diesel::QueryableByName)]
            struct Id {
                #[diesel(sql_type = diesel::sql_types::BigInt)]
                #[allow(dead_code)]
                id: i64,
            }
            $crate::backend::stmt::stmt($crate::backend::shared::ROW_HELD)
                .bind::<diesel::sql_types::BigInt, _>(id)
                .bind::<diesel::sql_types::Text, _>(holder)
                .get_result::<Id>(self)
                .optional()
                .map(|r| r.is_some())
        }
    };
    (@line_leave) => {
        fn line_leave(
            &mut self,
            _key: &str,
            _line: $crate::backend::Line,
            id: i64,
        ) -> diesel::QueryResult<bool> {
            use diesel::RunQueryDsl as _;
            // No RETURNING on MySQL: a place not granted goes in one statement (a locking
            // delete of the newest version, which waits for a grant under way); only one
            // that was granted is deleted by a second, and the caller gives the key back.
            // Again while the server reports contention: a DELETE of a place can be the
            // deadlock victim of a release reading the key's places (`delete_place` in
            // mysql/locks.rs), and a granted place left would hold the key up until it
            // lapses. Not inside a transaction (a reader's or permit's acquisition), which
            // the deadlock rolled back whole: there it goes up (`statement_retryable`).
            $crate::backoff::retry_contended(
                self,
                std::time::Duration::from_millis(64),
                "leaving the line",
                |c| {
                    let n = $crate::backend::stmt::stmt($crate::backend::shared::LEAVE_UNGRANTED)
                        .bind::<diesel::sql_types::BigInt, _>(id)
                        .execute(c)?;
                    if n == 1 {
                        return Ok(false);
                    }
                    $crate::backend::stmt::stmt($crate::backend::shared::LEAVE_PLACE)
                        .bind::<diesel::sql_types::BigInt, _>(id)
                        .execute(c)
                        .map(|n| n == 1)
                },
                super::statement_retryable,
            )
        }
    };
    (@lease_release) => {
        fn lease_release(&mut self, key: &str, holder: &str) -> diesel::QueryResult<bool> {
            use diesel::RunQueryDsl as _;
            $crate::backend::stmt::stmt($crate::backend::shared::LEASE_RELEASE)
                .bind::<diesel::sql_types::Text, _>(key)
                .bind::<diesel::sql_types::Text, _>(holder)
                .execute(self)
                .map(|n| n == 1)
        }
    };
    (@create_header) => {
        fn create_header(&mut self, key: &str, permits: i64) -> diesel::QueryResult<()> {
            use diesel::RunQueryDsl as _;
            $crate::backend::stmt::stmt($crate::backend::shared::CREATE_HEADER)
                .bind::<diesel::sql_types::Text, _>(key)
                .bind::<diesel::sql_types::BigInt, _>(permits)
                .execute(self)
                .map(drop)
        }
    };
    ($($name:ident),+ $(,)?) => {
        $($crate::backend::shared::statements!(@$name);)+
    };
}
pub(crate) use statements;
