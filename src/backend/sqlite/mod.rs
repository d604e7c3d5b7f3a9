//! SQLite: one writer at a time, so each acquire is one atomic statement. Time comes from
//! SQLite's own clock (`strftime('%Y-%m-%d %H:%M:%f', 'now')`), read by each process that
//! opens the file: all of them share one machine's clock, since SQLite's locking needs a
//! local file system.
//!
//! This file classifies the connection and its errors and runs the migrations; the
//! statements are in `locks.rs` (`Row`, `Lease`) and `admin.rs` (admin reads, force release,
//! purge, optimistic versions), the connection settings in `tuning.rs`. SQLite has no
//! session strategies (`Dialect::sessions` is `None`).

mod admin;
mod busy;
#[cfg(target_os = "linux")]
pub(crate) mod doorbell;
mod holders;
mod lines;
pub(super) mod locks;
mod tuning;

pub use tuning::SqliteTuning;

use super::migrate_with_retry;
use super::sealed::{Dialect, Seal, Sealed};
use super::Backend;
use crate::{Error, Result};
use chrono::NaiveDateTime;
use diesel::sql_types::Timestamp;
use diesel::sqlite::SqliteConnection;
use diesel_migrations::{embed_migrations, EmbeddedMigrations, MigrationHarness};

const MIGRATIONS: EmbeddedMigrations = embed_migrations!("migrations/sqlite");

/// SQLite modifiers take seconds; the value is bound as a parameter, never put in the SQL.
fn seconds(sign: char, us: i64) -> String {
    format!("{sign}{}.{:06} seconds", us / 1_000_000, us % 1_000_000)
}

super::shared::acquired_row!(Timestamp, NaiveDateTime, |t| t.and_utc());

impl Dialect for SqliteConnection {
    super::shared::statements!(schema_current);

    fn backend(&self) -> Backend {
        Backend::Sqlite
    }

    /// Without WAL, a commit waits for the readers to finish and can fail as busy after the
    /// statement has already returned its row; without a busy timeout, every collision is an
    /// error at once. A pool without `SqliteTuning` can therefore break mutual exclusion and
    /// issue a token twice, so it is refused.
    fn misconfigured(&mut self, _lines: bool) -> diesel::QueryResult<Option<String>> {
        use diesel::RunQueryDsl;
        #[derive(diesel::QueryableByName)]
        struct Mode {
            #[diesel(sql_type = diesel::sql_types::Text)]
            journal_mode: String,
        }
        #[derive(diesel::QueryableByName)]
        struct Timeout {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            timeout: i64,
        }
        let mode = super::stmt::stmt("PRAGMA journal_mode")
            .get_result::<Mode>(self)?
            .journal_mode;
        let timeout = super::stmt::stmt("PRAGMA busy_timeout")
            .get_result::<Timeout>(self)?
            .timeout;
        Ok(
            (!mode.eq_ignore_ascii_case("wal") || timeout <= 0).then(|| {
                format!(
                    "the pool's SQLite connections are not tuned for locks (journal_mode {mode}, \
                 busy_timeout {timeout} ms; WAL and a busy timeout are needed): install \
                 diesel_lock::SqliteTuning as the pool's connection customizer, or build the \
                 pool with diesel_lock::connect"
                )
            }),
        )
    }

    fn run_migrations(&mut self) -> Result<()> {
        // All pending migrations in one IMMEDIATE transaction (diesel runs each in a
        // savepoint inside it): concurrent migrators queue for the write lock, and no other
        // connection ever sees the tables half migrated.
        migrate_with_retry(self, |c| {
            c.immediate_transaction(|c| {
                c.run_pending_migrations(MIGRATIONS)
                    .map(drop)
                    .map_err(Error::Migration)
            })
        })
    }

    fn is_contention(&self, e: &diesel::result::Error) -> bool {
        match e {
            // SQLITE_BUSY / SQLITE_LOCKED after busy_timeout, or a snapshot that cannot be
            // upgraded to a write: another connection is writing.
            diesel::result::Error::DatabaseError(_, info) => {
                let m = info.message();
                m.contains("database is locked") || m.contains("database table is locked")
            }
            _ => false,
        }
    }
}

impl Sealed for SqliteConnection {
    fn dialect(&mut self, _: Seal) -> &mut dyn Dialect {
        self
    }

    fn static_backend(_: Seal) -> Option<Backend> {
        Some(Backend::Sqlite)
    }
}
