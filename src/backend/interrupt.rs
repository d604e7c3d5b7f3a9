//! Ending another session, to interrupt a wait in the server's lock queue from another
//! thread (`Cancel`): the session's id, and ending it by id from another connection. The
//! whole session is ended, not only its statement: a lock granted at the very moment the
//! wait is interrupted then dies with it, and nothing it held can outlive the cancelled wait.
//! SQLite has no server-side waits and needs none of this. The statements are in each
//! backend's `sessions.rs`.

/// A session that can be ended from another connection.
pub trait EndSession {
    /// This connection's server session id (PostgreSQL `pg_backend_pid()`, MySQL
    /// `CONNECTION_ID()`).
    fn session_id(&mut self) -> diesel::QueryResult<i64>;
    /// Ends the session `id` (which must belong to the same database user), from this
    /// connection; false if there was no such session.
    fn end_session(&mut self, id: i64) -> diesel::QueryResult<bool>;
}
