//! Ending another session, to interrupt a wait in the server's lock queue from another
//! thread (`Cancel`): the session's id, and ending it by id from another connection. The
//! whole session is ended, not only its statement: a lock granted at the very moment the
//! wait is interrupted then dies with it, and nothing it held can outlive the cancelled wait.
//! SQLite has no server-side waits and needs none of this. The statements are in each
//! backend's `sessions.rs`.
//!
//! Ending a session is asynchronous on both servers (`pg_terminate_backend` signals the
//! backend, `KILL CONNECTION` flags the thread): the session frees its locks as it exits,
//! a moment later. [`EndSession::end_session`] waits for that moment, so that a cancelled
//! wait that returns has given back whatever its session held, for the next `try` to find
//! free.

use std::time::{Duration, Instant};

/// How long [`EndSession::end_session`] waits for an ended session to be gone.
const GONE_WITHIN: Duration = Duration::from_secs(2);

/// A session that can be ended from another connection.
pub trait EndSession {
    /// This connection's server session id (PostgreSQL `pg_backend_pid()`, MySQL
    /// `CONNECTION_ID()`).
    fn session_id(&mut self) -> diesel::QueryResult<i64>;
    /// Asks the server to end the session `id` (which must belong to the same database
    /// user), from this connection; false if there was no such session. The session may
    /// still be there, and hold its locks, when this returns.
    fn kill_session(&mut self, id: i64) -> diesel::QueryResult<bool>;
    /// Whether the session `id` is still there (it holds its locks until it is gone).
    fn session_exists(&mut self, id: i64) -> diesel::QueryResult<bool>;
    /// Ends the session `id` and waits until it is gone, and its locks free (at most 2 s,
    /// then a warning); false if there was no such session.
    fn end_session(&mut self, id: i64) -> diesel::QueryResult<bool> {
        if !self.kill_session(id)? {
            return Ok(false);
        }
        let start = Instant::now();
        let mut pause = Duration::from_micros(200);
        while self.session_exists(id)? {
            if start.elapsed() >= GONE_WITHIN {
                log::warn!(
                    "session {id} was ended but is still there after {GONE_WITHIN:?}; its locks are freed when it exits"
                );
                break;
            }
            // No notification of a session's exit: a short, growing pause between looks.
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(10));
        }
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::EndSession;
    use diesel::sql_types::{BigInt, Text};
    use diesel::{sql_query, Connection, QueryableByName, RunQueryDsl};

    use crate::test_env::server_url as url;

    #[derive(QueryableByName)]
    struct Got {
        #[diesel(sql_type = BigInt)]
        got: i64,
    }

    /// Rounds of: a session takes a lock, another ends it, a third tries the lock at once
    /// and must find it free (the ended session gone with its locks, not only flagged).
    fn ended_sessions_hold_nothing<C: Connection + EndSession>(
        url: &str,
        take: impl Fn(&mut C),
        try_take: impl Fn(&mut C) -> bool,
        untake: impl Fn(&mut C),
    ) {
        let mut killer = C::establish(url).unwrap();
        let mut other = C::establish(url).unwrap();
        for round in 0..30 {
            let mut holder = C::establish(url).unwrap();
            take(&mut holder);
            let id = holder.session_id().unwrap();
            assert!(
                killer.end_session(id).unwrap(),
                "round {round}: no session {id}"
            );
            assert!(!killer.session_exists(id).unwrap());
            assert!(
                try_take(&mut other),
                "round {round}: the ended session's lock was still held"
            );
            untake(&mut other);
        }
        // No such session: false, not an error.
        assert!(!killer.end_session(i64::from(i32::MAX)).unwrap());
    }

    #[cfg(feature = "postgres")]
    #[test]
    fn an_ended_postgres_session_holds_nothing_once_end_session_returns() {
        let Some(url) = url("DLOCK_TEST_PG_URL", "pg") else {
            return;
        };
        // A key of this process's own (advisory locks are per database, shared by runs).
        let key = 0x0d10_c000_0000 + i64::from(std::process::id());
        ended_sessions_hold_nothing::<diesel::PgConnection>(
            &url,
            |c| {
                sql_query("SELECT pg_advisory_lock($1)")
                    .bind::<BigInt, _>(key)
                    .execute(c)
                    .unwrap();
            },
            |c| {
                sql_query("SELECT CAST(pg_try_advisory_lock($1) AS integer)::bigint AS got")
                    .bind::<BigInt, _>(key)
                    .get_result::<Got>(c)
                    .unwrap()
                    .got
                    == 1
            },
            |c| {
                sql_query("SELECT pg_advisory_unlock($1)")
                    .bind::<BigInt, _>(key)
                    .execute(c)
                    .unwrap();
            },
        );
    }

    #[cfg(feature = "mysql")]
    #[test]
    fn an_ended_mysql_session_holds_nothing_once_end_session_returns() {
        let Some(url) = url("DLOCK_TEST_MYSQL_URL", "mysql") else {
            return;
        };
        // A name of this process's own (lock names are server-wide, shared by runs).
        let name = format!("dlock-unit-end-session-{}", std::process::id());
        ended_sessions_hold_nothing::<diesel::MysqlConnection>(
            &url,
            |c| {
                sql_query("DO GET_LOCK(?, 10)")
                    .bind::<Text, _>(&name)
                    .execute(c)
                    .unwrap();
            },
            |c| {
                sql_query("SELECT CAST(GET_LOCK(?, 0) AS SIGNED) AS got")
                    .bind::<Text, _>(&name)
                    .get_result::<Got>(c)
                    .unwrap()
                    .got
                    == 1
            },
            |c| {
                sql_query("DO RELEASE_LOCK(?)")
                    .bind::<Text, _>(&name)
                    .execute(c)
                    .unwrap();
            },
        );
    }
}
