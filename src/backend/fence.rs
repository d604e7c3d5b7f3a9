//! The fencing tokens of the session strategies (`ForUpdate`, `Advisory`), written once for
//! the backends that have them; each backend's statements are in its `fence.rs`.
//!
//! A token is `source + off`: `source` increases for as long as the server runs (a
//! PostgreSQL sequence; MySQL's and MariaDB's `UUID_SHORT()`, a server-wide counter) but
//! need not survive a crash of the server; `off` is fixed once per life of the server (kept where a restart
//! empties it: an UNLOGGED table, a MEMORY table). Every token handed out is at most the
//! durable bound `high` (`dlock_fence`), which is raised, and flushed, before a token above
//! it is handed out, so that a token never waits for a flush of its own: the raise does, by
//! 2^20 at a time (each session raises on its own: about once per 2^20 tokens per session,
//! and on MySQL once more per new session, which reads the bound into its variables).
//! After a restart the first acquisition finds no `off` and starts the new life above the
//! bound: `off = high + 1 - source`. So tokens increase across holder crashes (the source
//! is never rolled back) and across server crashes (each life starts above all of the last).
//!
//! The tokens are global: one source for every key and for both strategies, so a key's
//! tokens increase but skip the values other keys took.

// Only the server backends draw tokens this way: a SQLite-only build uses none of it.
#![cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]

pub(crate) use crate::backend::sealed::Drawn;
use crate::backend::SessionLocks;
use diesel::QueryResult;

/// How far a raise of the durable bound goes beyond the token that needed it: one flush per
/// this many tokens. After a crash, tokens resume above the last bound: at most this far
/// above the last token handed out.
pub(crate) const STEP: i64 = 1 << 20;

impl Drawn {
    /// The token if it may be handed out now; else what `SessionLocks::fence_prepare` needs:
    /// the token to raise the bound past, or `None` to start (or join) the server's life.
    pub(crate) fn checked(self) -> Result<i64, Option<i64>> {
        match (self.token, self.high) {
            (Some(t), Some(h)) if t <= h => Ok(t),
            (Some(t), Some(_)) => Err(Some(t)),
            _ => Err(None),
        }
    }
}

/// A token that may be handed out, for a session that holds its lock already (Advisory):
/// `drawn` if it is, else after raising the bound past it or after joining the server's
/// life and drawing again.
pub(crate) fn secure(conn: &mut dyn SessionLocks, mut drawn: Drawn) -> QueryResult<i64> {
    // A life is joined once and a raise leaves STEP tokens of room: three rounds are more
    // than enough unless the tables are broken.
    for _ in 0..3 {
        match drawn.checked() {
            Ok(t) => return Ok(t),
            Err(Some(t)) => {
                conn.fence_prepare(Some(t))?;
                return Ok(t);
            }
            Err(None) => {
                conn.fence_prepare(None)?;
                drawn = conn.fence_draw()?;
            }
        }
    }
    Err(no_token())
}

/// The error of an acquisition that could not make a token safe in the rounds it allows:
/// only broken fence tables do that.
pub(crate) fn no_token() -> diesel::result::Error {
    diesel::result::Error::QueryBuilderError(
        "no fencing token could be drawn: is the dlock_fence row missing? run migrate()".into(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_goes_out_only_at_or_below_the_bound() {
        let d = |token, high| Drawn { token, high };
        assert_eq!(d(Some(5), Some(5)).checked(), Ok(5));
        assert_eq!(d(Some(6), Some(5)).checked(), Err(Some(6)));
        assert_eq!(d(None, Some(5)).checked(), Err(None));
        assert_eq!(d(Some(5), None).checked(), Err(None));
        assert_eq!(d(None, None).checked(), Err(None));
    }
}
