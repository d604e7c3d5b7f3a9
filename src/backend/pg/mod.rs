//! PostgreSQL: every acquire and every release is one statement (a `Lease` newcomer whose
//! key has no row yet: two, the second inserting it).
//!
//! This file classifies the connection and its errors and runs the migrations; the
//! statements are in `locks.rs` (`Row`, `Lease`), `sessions.rs` (`ForUpdate`, `Advisory`)
//! and `admin.rs` (admin reads, force release, purge, optimistic versions).

/// The epoch of every token handed out on this server, as SQL: `(T - 1) * 2^48`, where `T`
/// is the server's current timeline, which every promotion of a standby raises by one (the
/// first 8 hex digits of the current WAL file's name). Per-key counters (`Row`, `Lease`,
/// their holders) take the next token as `GREATEST(last + 1, epoch + 1)`, and every life of
/// the session strategies' token source starts above it (`fence.rs`), so a token handed out
/// after a promotion exceeds every token of the timeline before, even those a lagging
/// standby never received. A server that was never promoted (timeline 1) has epoch 0: its
/// tokens are those of the counters alone. It holds while a timeline hands out fewer than
/// 2^48 tokens per key (or per life), for up to 2^15 timelines. Cost: two function calls on
/// shared memory, no I/O (about 0.3 µs).
macro_rules! pg_epoch {
    () => {
        "((('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int8 - 1) \
          * 281474976710656)"
    };
}

/// The next token of a key whose counter (`$last`, an SQL expression: the last token handed
/// out) is there: one more, never below the epoch. With `pg_first_token!` and the floor's
/// CTE (`pg_floor!`), the one place where PostgreSQL's `Row` and `Lease` tokens are computed.
macro_rules! pg_next_token {
    ($last:literal) => {
        concat!("GREATEST(", $last, " + 1, ", pg_epoch!(), " + 1)")
    };
}

/// The first token of a key that has no counter row: above the floor (`f.floor_token`, read by
/// the CTE `pg_floor!` makes) and above `$saved` (an SQL expression: a counter kept for the
/// key elsewhere, or 0), never below the epoch.
macro_rules! pg_first_token {
    ($saved:literal) => {
        concat!(
            "GREATEST(f.floor_token, ",
            $saved,
            ", ",
            pg_epoch!(),
            ") + 1"
        )
    };
}

/// The CTE `f`: the floor of the key's bucket (bound first), locked FOR SHARE, when `$cond`
/// (SQL, after the bucket, in pieces as `concat!` takes them) holds. A purge raises the floor (an UPDATE, which waits for this
/// lock and which this lock waits for) and commits that before it deletes any counter
/// (`admin.rs`), so the value read here, the newest whatever the statement's snapshot, is at
/// least every token of a key whose counter row was gone when this statement inserted its
/// own: either that purge's raise committed before this lock was granted, or its deletes
/// come after this statement commits. A snapshot read of the floor would not do: an
/// `INSERT … ON CONFLICT` that finds the conflicting row deleted meanwhile inserts values
/// computed from the old snapshot.
macro_rules! pg_floor {
    ($($cond:expr),+) => {
        concat!(
            "f AS (SELECT floor_token FROM dlock_token_floor WHERE bucket = ? AND ",
            $($cond,)+
            " FOR SHARE)"
        )
    };
}

mod admin;
mod fence;
mod for_share;
mod holders;
mod lines;
pub(crate) mod listen;
pub(super) mod locks;
pub(super) mod sessions;
mod shared_sessions;
mod socket;

use super::sealed::{Dialect, Seal, Sealed, SessionLocks};
use super::stmt::stmt;
use super::{migrate_with_retry, Backend};
use crate::{Error, Result};
use chrono::{DateTime, Utc};
use diesel::pg::PgConnection;
use diesel::sql_types::{BigInt, Timestamptz};
use diesel::Connection;
use diesel::RunQueryDsl;
use diesel_migrations::{embed_migrations, EmbeddedMigrations, MigrationHarness};

const MIGRATIONS: EmbeddedMigrations = embed_migrations!("migrations/postgres");

/// Serialises concurrent `migrate()` calls across processes (key_hash("diesel-lock/migrate")
/// is not needed here: any constant outside the range users pick by hand will do).
const MIGRATION_LOCK: i64 = 0x646c_6f63_6b5f_6d69; // "dlock_mi"

super::shared::acquired_row!(Timestamptz, DateTime<Utc>, |t| t);

/// `lock_timeout` as PostgreSQL reads it: whole milliseconds, rounded up so that the server
/// never gives up before the caller's deadline; at least 1, because 0 means "no limit"; at
/// most 2147483647 (~24.8 days), the largest it accepts: a longer wait ends there as busy,
/// and the locker waits again until its deadline.
fn lock_timeout_ms(d: std::time::Duration) -> String {
    let ms = d.as_micros().div_ceil(1000).clamp(1, i32::MAX as u128);
    ms.to_string()
}

/// Bounds the open transaction on the server (`SET LOCAL`, so it ends with the transaction,
/// and is safe behind a transaction-pooling PgBouncer): idle between two statements longer
/// than `idle` (its client stopped, hung or cut off), the server ends the session, and the
/// locks it holds go; with `lock`, each wait for a lock ends after that long (busy).
fn bound_transaction(
    c: &mut PgConnection,
    idle: std::time::Duration,
    lock: Option<std::time::Duration>,
) -> diesel::QueryResult<()> {
    stmt(
        "SELECT set_config('idle_in_transaction_session_timeout', ?, true), \
                CASE WHEN ? IS NOT NULL THEN set_config('lock_timeout', ?, true) END",
    )
    .bind::<diesel::sql_types::Text, _>(lock_timeout_ms(idle))
    .bind::<diesel::sql_types::Nullable<diesel::sql_types::Text>, _>(lock.map(lock_timeout_ms))
    .bind::<diesel::sql_types::Nullable<diesel::sql_types::Text>, _>(lock.map(lock_timeout_ms))
    .execute(c)
    .map(drop)
}

/// True if `e` says the lock is someone else's (see `SessionLocks::is_lock_unavailable`).
/// The advisory lock (two `int4` keys: a space of its own beside the one-`bigint` keys of
/// the `Advisory` strategy) that a `ForUpdate` purge's batch holds exclusively from before
/// it locks a key row until it commits, and that an acquisition which found its row locked
/// waits for in shared mode (`SessionLocks::for_update_present`): "dloc", "purg".
pub(crate) const PURGE_GATE: (i32, i32) = (0x646c_6f63, 0x7075_7267);

fn lock_unavailable(e: &diesel::result::Error) -> bool {
    // Both cases are SQLSTATE 55P03 (lock_not_available), but diesel keeps no SQLSTATE
    // for it (DatabaseErrorKind::Unknown), so the primary message is matched. These
    // are the server's English texts: a server whose lc_messages translates them makes
    // a busy lock surface as Error::Database, never as a false success.
    // - NOWAIT: `could not obtain lock on row in relation "dlock_for_update"`
    // - lock_timeout: `canceling statement due to lock timeout`
    //   (statement_timeout says "due to statement timeout" and is a real error)
    match e {
        diesel::result::Error::DatabaseError(_, info) => {
            let m = info.message();
            m.starts_with("could not obtain lock on row")
                || m.starts_with("canceling statement due to lock timeout")
        }
        _ => false,
    }
}

/// True if `e` means someone else is competing for the lock (see `Dialect::is_contention`):
/// every error `lock_unavailable` accepts, and a serialization failure or a deadlock.
fn contention(e: &diesel::result::Error) -> bool {
    // 55P03 lock_not_available has no diesel kind: `lock_unavailable` reads its message.
    rolled_back(e) || lock_unavailable(e)
}

/// True if `e` is a serialization failure (40001) or a deadlock (40P01, which has no diesel
/// kind: recognised by its message): the statement was rolled back and may run again.
fn rolled_back(e: &diesel::result::Error) -> bool {
    use diesel::result::{DatabaseErrorKind, Error as E};
    match e {
        E::DatabaseError(DatabaseErrorKind::SerializationFailure, _) => true,
        E::DatabaseError(_, info) => info.message().starts_with("deadlock detected"),
        _ => false,
    }
}

impl Dialect for PgConnection {
    super::shared::statements!(schema_current);

    fn backend(&self) -> Backend {
        Backend::Postgres
    }

    fn run_migrations(&mut self) -> Result<()> {
        // One transaction for all of them (diesel runs each in a savepoint inside it): DDL is
        // transactional here, so other sessions see the old schema or the new, never half.
        // Migrators are serialised by a transaction-level advisory lock taken first in that
        // transaction: it ends with the transaction, so it works through a transaction
        // pooler too (a session-level lock would stay with whichever server session the
        // pooler picked, and block every later migration on other sessions).
        migrate_with_retry(self, |c| {
            c.transaction(|c| {
                stmt("SELECT pg_advisory_xact_lock(?)")
                    .bind::<BigInt, _>(MIGRATION_LOCK)
                    .execute(c)?;
                c.run_pending_migrations(MIGRATIONS)
                    .map(drop)
                    .map_err(Error::Migration)
            })
        })
    }

    /// SERIALIZABLE sessions are refused, REPEATABLE READ ones warned of for a strategy with
    /// a line: `Locker::connect` sets READ COMMITTED on the sessions it opens directly
    /// (`AnyTuning`), so this meets pools of the caller's own and those through a pooler.
    /// Exclusion and tokens hold at REPEATABLE READ, and `ForUpdate` runs again what the
    /// server rolls back, but newcomers passed earlier waiters while the line's statements
    /// were run again (an adversary, 28 Nov).
    fn misconfigured(&mut self, lines: bool) -> diesel::QueryResult<Option<String>> {
        const HOW: &str = "set default_transaction_isolation = 'read committed' for the role \
                           or database (ALTER ROLE ... SET ...), or in your pool's connection \
                           customizer, or build the Locker with Locker::connect (not through \
                           a transaction pooler)";
        #[derive(diesel::QueryableByName)]
        struct Level {
            #[diesel(sql_type = diesel::sql_types::Text)]
            level: String,
        }
        let level = stmt("SELECT current_setting('transaction_isolation') AS level")
            .get_result::<Level>(self)?
            .level;
        Ok(match level.as_str() {
            "serializable" => Some(format!(
                "the pool's PostgreSQL sessions run at SERIALIZABLE, where the server aborts \
                 holders' checks and acquisitions: {HOW}"
            )),
            "repeatable read" if lines => {
                log::warn!(
                    "the pool's PostgreSQL sessions run at REPEATABLE READ: locks and tokens \
                     hold, but newcomers can take a key past earlier waiters while the line's \
                     statements meet serialization failures; for the line's order, {HOW}"
                );
                None
            }
            _ => None,
        })
    }

    fn is_contention(&self, e: &diesel::result::Error) -> bool {
        contention(e)
    }

    fn is_rolled_back(&self, e: &diesel::result::Error) -> bool {
        rolled_back(e)
    }

    fn sessions(&mut self) -> Option<&mut dyn SessionLocks> {
        Some(self)
    }

    fn shared_sessions(&mut self) -> Option<&mut dyn super::holders::SharedSessionLocks> {
        Some(self)
    }
    fn for_share(&mut self) -> Option<&mut dyn super::for_share::ForShareLocks> {
        Some(self)
    }
}

impl Sealed for PgConnection {
    fn dialect(&mut self, _: Seal) -> &mut dyn Dialect {
        self
    }

    fn static_backend(_: Seal) -> Option<Backend> {
        Some(Backend::Postgres)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use diesel::result::{DatabaseErrorKind, Error as E};

    fn db_error(message: &str) -> E {
        E::DatabaseError(DatabaseErrorKind::Unknown, Box::new(message.to_owned()))
    }

    /// 55P03 from NOWAIT and from lock_timeout: busy.
    const BUSY: [&str; 2] = [
        "could not obtain lock on row in relation \"dlock_for_update\"",
        "canceling statement due to lock timeout",
    ];

    /// The exact texts PostgreSQL 15 sends (English lc_messages); the integration tests in
    /// tests/session_faults.rs meet both against a real server.
    #[test]
    fn lock_unavailable_is_told_from_real_errors() {
        for busy in BUSY {
            assert!(lock_unavailable(&db_error(busy)), "{busy}");
        }
        // A statement_timeout (57014), a deadlock (40P01, retried by the locker as
        // contention, but not "busy") and a lost connection are real errors here.
        for real in [
            "canceling statement due to statement timeout",
            "deadlock detected",
            "terminating connection due to administrator command",
            "relation \"dlock_for_update\" does not exist",
        ] {
            assert!(!lock_unavailable(&db_error(real)), "{real}");
        }
        assert!(!lock_unavailable(&E::NotFound));
    }

    /// A busy lock is contention too (the locker retries it), and so is a deadlock, which is
    /// not "busy"; a statement timeout or a lost connection is neither.
    #[test]
    fn contention_is_every_busy_lock_and_a_deadlock() {
        for busy in BUSY {
            assert!(contention(&db_error(busy)), "{busy}");
        }
        assert!(contention(&db_error(
            "deadlock detected\nDETAIL: Process 1 waits for ShareLock"
        )));
        assert!(contention(&E::DatabaseError(
            DatabaseErrorKind::SerializationFailure,
            Box::new("could not serialize access".to_owned())
        )));
        for real in [
            "canceling statement due to statement timeout",
            "terminating connection due to administrator command",
        ] {
            assert!(!contention(&db_error(real)), "{real}");
        }
        assert!(!contention(&E::NotFound));
    }

    #[test]
    fn lock_timeout_is_whole_milliseconds_rounded_up_within_what_postgres_takes() {
        assert_eq!(lock_timeout_ms(std::time::Duration::from_micros(1)), "1");
        assert_eq!(lock_timeout_ms(std::time::Duration::from_micros(1001)), "2");
        assert_eq!(
            lock_timeout_ms(std::time::Duration::from_secs(30 * 24 * 3600)),
            "2147483647"
        );
    }
}
