//! Whose line a place of `dlock_waiters` is in (`Line`), and the SQL literals of the
//! strategies that write it beside the key (`line_sql!`).

/// The `dlock_waiters.line` of a lock's line, as the SQL literal the statements of one
/// strategy write beside the key (`AND w.line = 1`): the values of [`Line`], whose unit test
/// checks that they agree. Defined before the backends' modules, which use it.
macro_rules! line_sql {
    (lease) => {
        "0"
    };
    (row) => {
        "1"
    };
}

/// A grant of a key to a place as the releasing statement told it (PostgreSQL: the grant's
/// notification, `pg/listen.rs`'s `grant_in`), kept for the place's waiter
/// (`Queues::wake_granted`), which takes it with no look (`Place::told`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(not(feature = "postgres"), allow(dead_code))]
pub(crate) struct Told {
    /// The place's id (`dlock_waiters.id`).
    pub(crate) place: i64,
    /// The holder id the place was taken with.
    pub(crate) holder: String,
    /// The key's token the grant gave.
    pub(crate) token: i64,
    /// When the grant took the key, in microseconds since the epoch.
    pub(crate) acquired_us: i64,
}

/// Whose line a place is in (`dlock_waiters.line`). A key's name is not a lock: a `Row`
/// lock, a `Lease` lock (its writers, readers and permits together), a `ForUpdate`
/// semaphore and an `Advisory` semaphore of the same name are four locks, each with a line
/// of its own, so that a release hands a key only to a waiter for that lock and a waiter
/// holds up only its own lock's newcomers. Places of a build from before the column
/// (migration 20) are in `Lease`'s line, its default.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Line {
    /// A `Lease` key's writers, readers and permits (`line_sql!(lease)`).
    Lease = 0,
    /// A `Row` key's waiters (`line_sql!(row)`).
    Row = 1,
    /// A `ForUpdate` semaphore's permits.
    ForUpdatePermits = 2,
    /// An `Advisory` semaphore's permits.
    AdvisoryPermits = 3,
}

impl Line {
    /// The value of `dlock_waiters.line`.
    pub(crate) fn id(self) -> i32 {
        self as i32
    }

    /// The line of a value read back (`LineStat::line`); `None` for one this build does not
    /// know (a newer build's).
    pub(crate) fn from_id(id: i64) -> Option<Line> {
        [
            Line::Lease,
            Line::Row,
            Line::ForUpdatePermits,
            Line::AdvisoryPermits,
        ]
        .into_iter()
        .find(|l| i64::from(l.id()) == id)
    }

    /// The lock whose line this is, as `dlock list` names it.
    pub(crate) fn kind(self) -> crate::StrategyKind {
        match self {
            Line::Lease => crate::StrategyKind::Lease,
            Line::Row => crate::StrategyKind::Row,
            Line::ForUpdatePermits => crate::StrategyKind::ForUpdate,
            Line::AdvisoryPermits => crate::StrategyKind::Advisory,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Line;
    use crate::StrategyKind;

    #[test]
    fn the_lines_sql_literals_are_their_ids() {
        assert_eq!(line_sql!(lease), Line::Lease.id().to_string());
        assert_eq!(line_sql!(row), Line::Row.id().to_string());
        for l in [
            Line::Lease,
            Line::Row,
            Line::ForUpdatePermits,
            Line::AdvisoryPermits,
        ] {
            assert_eq!(Line::from_id(l.id().into()), Some(l));
        }
        assert_eq!(Line::from_id(4), None);
    }

    #[test]
    fn each_line_is_its_own_locks() {
        assert_eq!(Line::Lease.kind(), StrategyKind::Lease);
        assert_eq!(Line::Row.kind(), StrategyKind::Row);
        assert_eq!(Line::ForUpdatePermits.kind(), StrategyKind::ForUpdate);
        assert_eq!(Line::AdvisoryPermits.kind(), StrategyKind::Advisory);
    }
}
