//! MySQL and MariaDB. Without `RETURNING` on MySQL, an acquisition that wins reads its token
//! back with a second statement; a failed one costs one statement.
//!
//! This file classifies the connection and its errors and runs the migrations; the
//! statements are in `locks.rs` (`Row`, `Lease`), `sessions.rs` (`ForUpdate`, `Advisory`)
//! and `admin.rs` (admin reads, force release, purge, optimistic versions).

/// The floor of every token handed out on this server, as SQL: the server's clock in
/// microseconds since 1970 (UTC; about 1.8e15 in 2026). MySQL has no counter of promotions
/// like PostgreSQL's timeline, so the clock stands in for one: per-key counters (`Row`,
/// `Lease`, their holders) take the next token as `GREATEST(last + 1, floor)`, and each life
/// of the session strategies' token source starts above it (`fence.rs`). A key's tokens
/// still increase by the counter alone, whatever the clock does; and a token handed out
/// after a failover exceeds the old primary's tokens, even those a lagging replica never
/// received, as long as the new primary's clock is not behind the old one's by more than
/// the time between the old primary's last acquisition and the new one's first (a key is
/// not taken more than once per microsecond, so its counter never runs ahead of the clock).
macro_rules! mysql_floor {
    () => {
        "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))"
    };
}

/// The token floor's read (migration 15), the one place where MySQL's `Row` and `Lease`
/// counters meet it: `FROM` this, a key's first token is above `f.floor_token`. The key's
/// bucket is bound. A locking read (LOCK IN SHARE MODE: MariaDB and MySQL 8 alike) returns
/// the newest committed floor at any isolation level, and a purge's raise (an UPDATE) waits
/// for it and it for the raise: a purge commits its raise before it deletes any counter
/// (`admin.rs`), so the floor read here is at least every token of a key whose counter row
/// was gone when this statement inserted its own.
macro_rules! mysql_floor_read {
    () => {
        "FROM dlock_token_floor f WHERE f.bucket = ? LOCK IN SHARE MODE"
    };
}

mod admin;
mod fence;
mod for_share;
pub(super) mod handover;
mod holders;
mod lines;
pub(super) mod locks;
pub(super) mod sessions;

use super::sealed::{Dialect, Seal, Sealed, SessionLocks};
use super::shared::One;
use super::stmt::stmt;
use super::{migrate_with_retry, Backend};
use crate::{Error, Result};
use chrono::NaiveDateTime;
use diesel::mysql::MysqlConnection;
use diesel::sql_types::{BigInt, Datetime};
use diesel::{QueryResult, QueryableByName, RunQueryDsl};
use diesel_migrations::{embed_migrations, EmbeddedMigrations, MigrationHarness};

const MIGRATIONS: EmbeddedMigrations = embed_migrations!("migrations/mysql");

super::shared::acquired_row!(Datetime, NaiveDateTime, |t| t.and_utc());

/// True if `e` says the lock is someone else's (see `SessionLocks::is_lock_unavailable`).
/// A `GET_LOCK` name that is the current database's own: `$prefix` then the MD5 of the
/// database's name (named locks are the server's; 64 characters at most, which a database
/// name alone could fill). A SQL expression, written where the statements take a lock name.
macro_rules! per_database {
    ($prefix:literal) => {
        concat!("CONCAT('", $prefix, "', MD5(COALESCE(DATABASE(), '')))")
    };
}
pub(crate) use per_database;

/// The named lock that a `ForUpdate` purge's batch holds from before it locks a key row
/// until it has committed, and that an acquisition which found its row locked looks at
/// (`SessionLocks::for_update_present`): the database's own (`per_database!`), so a purge of
/// another database on the same server holds up nothing here.
macro_rules! purge_gate {
    () => {
        $crate::backend::mysql::per_database!("dlock_purge_gate:")
    };
}
pub(crate) use purge_gate;

fn lock_unavailable(e: &diesel::result::Error) -> bool {
    // diesel maps neither error to a kind of its own (DatabaseErrorKind::Unknown) and
    // keeps no error number, so the server's English message is matched:
    // - MySQL 8, NOWAIT (3572, ER_LOCK_NOWAIT): "Statement aborted because lock(s)
    //   could not be acquired immediately and NOWAIT is set."
    // - MariaDB, NOWAIT, and both servers when innodb_lock_wait_timeout runs out (1205,
    //   ER_LOCK_WAIT_TIMEOUT): "Lock wait timeout exceeded; try restarting transaction"
    // MariaDB cannot tell its NOWAIT refusal from a real wait timeout, and need not:
    // either way the row is someone else's.
    match e {
        diesel::result::Error::DatabaseError(_, info) => {
            let m = info.message();
            m.starts_with("Lock wait timeout exceeded") || m.contains("NOWAIT is set")
        }
        _ => false,
    }
}

/// True if `e` means someone else is competing for the lock (see `Dialect::is_contention`):
/// every error `lock_unavailable` accepts, and a deadlock.
fn contention(e: &diesel::result::Error) -> bool {
    // 1205 "Lock wait timeout exceeded" (also MariaDB's answer to NOWAIT) and 3572 (MySQL's
    // NOWAIT) come through with their message only, which `lock_unavailable` reads.
    deadlock(e) || lock_unavailable(e)
}

/// Whether a statement that failed with `e` may run again by itself (`retry_contended`):
/// contention, outside a transaction. Inside one, a deadlock (or a Galera certification
/// conflict) rolled back the whole transaction, whose earlier statements went with it, and
/// the session went on in autocommit: the statement run again committed alone, and the
/// caller's COMMIT committed nothing (a permit taken from the line reported taken with no
/// holder row: `tests/handover.rs`, `permit_whose_line_leaving_is_a_deadlock_victim_…`). A
/// lock wait that ran out keeps the transaction, unless the server rolls back on timeouts
/// (`innodb_rollback_on_timeout`). So inside a transaction the error goes up, the
/// transaction is rolled back, and its caller runs it again as a whole or counts it busy.
pub(super) fn statement_retryable(c: &mut MysqlConnection, e: &diesel::result::Error) -> bool {
    contention(e) && !in_transaction(c)
}

/// As `statement_retryable`, for the statements run again only as a deadlock's victims.
pub(super) fn deadlock_retryable(c: &mut MysqlConnection, e: &diesel::result::Error) -> bool {
    deadlock(e) && !in_transaction(c)
}

/// Is a transaction of diesel's open on `c`? (If its state cannot be read, taken as open.)
fn in_transaction(c: &mut MysqlConnection) -> bool {
    use diesel::connection::{AnsiTransactionManager, TransactionManager};
    !matches!(
        AnsiTransactionManager::transaction_manager_status_mut(c).transaction_depth(),
        Ok(None)
    )
}

/// True if `e` says the server rolled the statement back to end a deadlock (1213, which
/// diesel maps to `SerializationFailure`; recognised by its message too), or a Galera node
/// aborted it in certification (the same error): the statement did nothing, and running it
/// again at once is safe. Unlike `contention`, not a lock wait that ran out, which would
/// wait as long again.
pub(super) fn deadlock(e: &diesel::result::Error) -> bool {
    use diesel::result::{DatabaseErrorKind, Error as E};
    match e {
        E::DatabaseError(DatabaseErrorKind::SerializationFailure, _) => true,
        E::DatabaseError(_, info) => info.message().starts_with("Deadlock found"),
        _ => false,
    }
}

/// Runs `f` with the session's `innodb_lock_wait_timeout` set to `seconds` (whole seconds,
/// 1 to 100,000,000, the range the server takes), then puts the session's own setting back,
/// as the connection goes back to the pool and on to other users. What `f` returns is
/// returned, unless putting the setting back fails.
fn with_lock_wait_timeout<T>(
    conn: &mut MysqlConnection,
    seconds: u64,
    f: impl FnOnce(&mut MysqlConnection) -> QueryResult<T>,
) -> QueryResult<T> {
    with_lock_wait_setting(conn, seconds.clamp(1, 100_000_000) as i64, f)
}

/// `with_lock_wait_timeout` with `seconds` as the server takes it: 0, on MariaDB only, is
/// no wait at all (a locked row is refused at once, as `NOWAIT`).
fn with_lock_wait_setting<T>(
    conn: &mut MysqlConnection,
    seconds: i64,
    f: impl FnOnce(&mut MysqlConnection) -> QueryResult<T>,
) -> QueryResult<T> {
    stmt(
        "SET @dlock_saved_wait = @@SESSION.innodb_lock_wait_timeout, \
         SESSION innodb_lock_wait_timeout = ?",
    )
    .bind::<BigInt, _>(seconds)
    .execute(conn)?;
    let result = f(conn);
    stmt("SET SESSION innodb_lock_wait_timeout = @dlock_saved_wait").execute(conn)?;
    result
}

/// Runs `f` with row lock waits as short as the server allows (MariaDB: none, a locked row
/// refused at once, as `NOWAIT`; MySQL proper: 1 s, the least it takes), then puts the
/// session's own setting back, as `with_lock_wait_timeout`.
fn with_least_lock_wait<T>(
    conn: &mut MysqlConnection,
    f: impl FnOnce(&mut MysqlConnection) -> QueryResult<T>,
) -> QueryResult<T> {
    stmt(
        "SET @dlock_saved_wait = @@SESSION.innodb_lock_wait_timeout, \
         SESSION innodb_lock_wait_timeout = IF(VERSION() LIKE '%MariaDB%', 0, 1)",
    )
    .execute(conn)?;
    let result = f(conn);
    stmt("SET SESSION innodb_lock_wait_timeout = @dlock_saved_wait").execute(conn)?;
    result
}

/// Whole seconds, rounded up, at least 1 (what `innodb_lock_wait_timeout` and MariaDB's
/// `idle_transaction_timeout` take; 0 would mean no limit).
fn whole_seconds(d: std::time::Duration) -> i64 {
    d.as_secs()
        .saturating_add(u64::from(d.subsec_nanos() > 0))
        .clamp(1, 100_000_000) as i64
}

/// Runs `f`, which opens and ends one transaction, with that transaction bounded on the
/// server, then puts the session's own settings back (the connection goes back to the pool
/// and on to other users): on MariaDB, idle between two statements longer than `idle` (its
/// client stopped, hung or cut off), the server ends the session (`idle_transaction_timeout`)
/// and the locks it holds go; with `lock`, each wait for a row lock ends after that long
/// (`innodb_lock_wait_timeout`: busy). Whole seconds, rounded up. MySQL proper has no idle
/// bound: the MariaDB-only part is in a `/*M! */` comment, which MySQL skips.
fn with_transaction_bounds<T>(
    conn: &mut MysqlConnection,
    idle: std::time::Duration,
    lock: Option<std::time::Duration>,
    f: impl FnOnce(&mut MysqlConnection) -> QueryResult<T>,
) -> QueryResult<T> {
    // A SET reads every value before it assigns any: the idle bound goes through a user
    // variable set by the statement before the one that applies it.
    stmt(
        "SET @dlock_bound_idle = ?, @dlock_bound_wait = @@SESSION.innodb_lock_wait_timeout, \
         SESSION innodb_lock_wait_timeout = \
             CAST(COALESCE(?, @@SESSION.innodb_lock_wait_timeout) AS UNSIGNED) \
         /*M!100300 , @dlock_bound_saved_idle = @@SESSION.idle_transaction_timeout */",
    )
    .bind::<BigInt, _>(whole_seconds(idle))
    .bind::<diesel::sql_types::Nullable<BigInt>, _>(lock.map(whole_seconds))
    .execute(conn)?;
    // From here on the session's settings are put back whatever happens (a failed SET, a
    // failed transaction): the connection goes back to the pool either way.
    let result = stmt(
        "SET /*M!100300 SESSION idle_transaction_timeout = CAST(@dlock_bound_idle AS UNSIGNED), */ \
         @dlock_bound_idle = NULL",
    )
    .execute(conn)
    .and_then(|_| f(conn));
    stmt(
        "SET SESSION innodb_lock_wait_timeout = @dlock_bound_wait \
         /*M!100300 , SESSION idle_transaction_timeout = @dlock_bound_saved_idle */",
    )
    .execute(conn)?;
    result
}

impl Dialect for MysqlConnection {
    super::shared::statements!(schema_current);

    fn backend(&self) -> Backend {
        Backend::Mysql
    }

    fn run_migrations(&mut self) -> Result<()> {
        // GET_LOCK serialises concurrent migrate() calls from many processes.
        let got = stmt(concat!(
            "SELECT CAST(GET_LOCK(",
            per_database!("diesel_lock.migrate:"),
            ", 60) AS SIGNED) AS one"
        ))
        .get_result::<One>(self)?;
        if got.one != 1 {
            return Err(Error::Migration(
                "another process held the migration lock for 60 s".into(),
            ));
        }
        let result = migrate_with_retry(self, |c| {
            c.run_pending_migrations(MIGRATIONS)
                .map(drop)
                .map_err(Error::Migration)
        });
        let unlocked = stmt(concat!(
            "SELECT CAST(RELEASE_LOCK(",
            per_database!("diesel_lock.migrate:"),
            ") AS SIGNED) AS one"
        ))
        .get_result::<One>(self);
        result?;
        unlocked?;
        Ok(())
    }

    fn misconfigured(&mut self, _lines: bool) -> QueryResult<Option<String>> {
        let autocommit = stmt("SELECT CAST(@@SESSION.autocommit AS SIGNED) AS one")
            .get_result::<One>(self)?
            .one;
        Ok((autocommit != 1).then(|| {
            "the pool's MySQL connections have autocommit off, so no lock would ever be \
             committed: run `SET SESSION autocommit = 1` in the pool's connection \
             customizer, or build the pool with diesel_lock::connect"
                .to_owned()
        }))
    }

    fn session_locks_local(&mut self) -> QueryResult<Option<&'static str>> {
        // SHOW, not @@GLOBAL.wsrep_on: MySQL proper, and MariaDB built without wsrep, have no
        // such variable (no row here; the @@ form would be an error).
        #[derive(QueryableByName)]
        struct Variable {
            #[diesel(sql_type = diesel::sql_types::Text, column_name = "Variable_name")]
            name: String,
            #[diesel(sql_type = diesel::sql_types::Text, column_name = "Value")]
            value: String,
        }
        // A node replicates only with a provider loaded (wsrep_provider 'none': a lone server).
        let vars = diesel::sql_query(
            "SHOW GLOBAL VARIABLES WHERE Variable_name IN ('wsrep_on', 'wsrep_provider')",
        )
        .load::<Variable>(self)?;
        let value = |n: &str| {
            vars.iter()
                .find(|v| v.name.eq_ignore_ascii_case(n))
                .map(|v| v.value.to_ascii_lowercase())
        };
        let on = matches!(value("wsrep_on").as_deref(), Some("on" | "1"))
            && !matches!(value("wsrep_provider").as_deref(), None | Some("none" | ""));
        Ok(on.then_some(
            "this server is a node of a Galera cluster (wsrep_on = ON): GET_LOCK and \
             FOR UPDATE row locks lock one node only, so clients on other nodes would hold \
             the same key at once, and UUID_SHORT() tokens are drawn per node; use \
             Strategy::Row or Strategy::Lease, whose writes on the key's primary key \
             certification orders across the nodes",
        ))
    }

    fn is_contention(&self, e: &diesel::result::Error) -> bool {
        contention(e)
    }

    fn is_rolled_back(&self, e: &diesel::result::Error) -> bool {
        deadlock(e)
    }

    fn sessions(&mut self) -> Option<&mut dyn SessionLocks> {
        Some(self)
    }
    fn for_share(&mut self) -> Option<&mut dyn super::for_share::ForShareLocks> {
        Some(self)
    }
}

impl Sealed for MysqlConnection {
    fn dialect(&mut self, _: Seal) -> &mut dyn Dialect {
        self
    }

    fn static_backend(_: Seal) -> Option<Backend> {
        Some(Backend::Mysql)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn whole_seconds_round_up_within_what_the_server_takes() {
        use std::time::Duration;
        assert_eq!(super::whole_seconds(Duration::ZERO), 1);
        assert_eq!(super::whole_seconds(Duration::from_millis(500)), 1);
        assert_eq!(super::whole_seconds(Duration::from_millis(1500)), 2);
        assert_eq!(super::whole_seconds(Duration::from_secs(2)), 2);
        assert_eq!(super::whole_seconds(Duration::MAX), 100_000_000);
    }

    use super::*;
    use diesel::result::{DatabaseErrorKind, Error as E};

    fn db_error(message: &str) -> E {
        E::DatabaseError(DatabaseErrorKind::Unknown, Box::new(message.to_owned()))
    }

    /// MySQL 8's NOWAIT (3572), and MariaDB's NOWAIT or either server's lock wait timeout
    /// (1205): busy.
    const BUSY: [&str; 2] = [
        "Statement aborted because lock(s) could not be acquired immediately and NOWAIT is set.",
        "Lock wait timeout exceeded; try restarting transaction",
    ];

    /// Failures that are not "busy"; the deadlock (first) is contention nonetheless.
    const NOT_BUSY: [&str; 5] = [
        "Deadlock found when trying to get lock; try restarting transaction",
        "Lost connection to MySQL server during query",
        "MySQL server has gone away",
        "Query execution was interrupted",
        "Table 'dlock_test.dlock_for_update' doesn't exist",
    ];

    /// The exact texts of MySQL 8 (3572) and of MariaDB / MySQL (1205). Only MariaDB runs
    /// here, so the 3572 path is tested by its text alone; tests/session_faults.rs meets
    /// 1205 from both NOWAIT and innodb_lock_wait_timeout against the real server.
    #[test]
    fn lock_unavailable_is_told_from_real_errors() {
        for busy in BUSY {
            assert!(lock_unavailable(&db_error(busy)), "{busy}");
        }
        for real in NOT_BUSY {
            assert!(!lock_unavailable(&db_error(real)), "{real}");
        }
    }

    /// A lock someone else holds is contention (the locker retries it), and so is a
    /// deadlock, with or without its diesel kind; a lost connection or a missing table is
    /// neither. `contention` asks `lock_unavailable` rather than keeping a list of its own,
    /// so the two cannot disagree on a busy lock.
    #[test]
    fn contention_is_every_busy_lock_and_a_deadlock() {
        for busy in BUSY {
            assert!(contention(&db_error(busy)), "{busy}");
        }
        let (deadlock, real) = NOT_BUSY.split_first().unwrap();
        assert!(contention(&db_error(deadlock)));
        assert!(contention(&E::DatabaseError(
            DatabaseErrorKind::SerializationFailure,
            Box::new(deadlock.to_string())
        )));
        for real in real {
            assert!(!contention(&db_error(real)), "{real}");
        }
        assert!(!contention(&E::NotFound));
    }
}
