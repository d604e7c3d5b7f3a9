//! Ending another session, to interrupt a wait in the server's lock queue from another
//! thread (`Cancel`): the session's id, and ending it by id from another connection. The
//! whole session is ended, not only its statement: a lock granted at the very moment the
//! wait is interrupted then dies with it, and nothing it held can outlive the cancelled wait.
//! SQLite has no server-side waits and needs none of this.

#[cfg(any(feature = "postgres", feature = "mysql"))]
use super::stmt::stmt;
#[cfg(any(feature = "postgres", feature = "mysql"))]
use diesel::sql_types::{BigInt, Bool};
#[cfg(any(feature = "postgres", feature = "mysql"))]
use diesel::{QueryResult, QueryableByName, RunQueryDsl};

/// A session that can be ended from another connection.
pub trait EndSession {
    /// This connection's server session id (PostgreSQL `pg_backend_pid()`, MySQL
    /// `CONNECTION_ID()`).
    fn session_id(&mut self) -> diesel::QueryResult<i64>;
    /// Ends the session `id` (which must belong to the same database user), from this
    /// connection; false if there was no such session.
    fn end_session(&mut self, id: i64) -> diesel::QueryResult<bool>;
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
#[derive(QueryableByName)]
struct Id {
    #[diesel(sql_type = BigInt)]
    id: i64,
}

#[cfg(feature = "postgres")]
impl EndSession for diesel::PgConnection {
    fn session_id(&mut self) -> QueryResult<i64> {
        stmt("SELECT pg_backend_pid()::bigint AS id")
            .get_result::<Id>(self)
            .map(|r| r.id)
    }

    fn end_session(&mut self, id: i64) -> QueryResult<bool> {
        #[derive(QueryableByName)]
        struct Ended {
            #[diesel(sql_type = Bool)]
            ended: bool,
        }
        stmt("SELECT pg_terminate_backend(CAST(? AS integer)) AS ended")
            .bind::<BigInt, _>(id)
            .get_result::<Ended>(self)
            .map(|r| r.ended)
    }
}

#[cfg(feature = "mysql")]
impl EndSession for diesel::MysqlConnection {
    fn session_id(&mut self) -> QueryResult<i64> {
        stmt("SELECT CAST(CONNECTION_ID() AS SIGNED) AS id")
            .get_result::<Id>(self)
            .map(|r| r.id)
    }

    fn end_session(&mut self, id: i64) -> QueryResult<bool> {
        match stmt("KILL CONNECTION ?")
            .bind::<BigInt, _>(id)
            .execute(self)
        {
            Ok(_) => Ok(true),
            // ER_NO_SUCH_THREAD: the session has ended already.
            Err(diesel::result::Error::DatabaseError(_, info))
                if info.message().starts_with("Unknown thread id") =>
            {
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }
}
