//! The conformance suite, once per backend × strategy.

mod common;

use diesel_lock::Strategy;
use std::time::Duration;

const ROW: Strategy = Strategy::Row { stale_after: None };
const ROW_STALE: Strategy = Strategy::Row {
    stale_after: Some(Duration::from_secs(60)),
};
const LEASE: Strategy = Strategy::Lease {
    ttl: Duration::from_secs(10),
};

conformance_suite!(sqlite_row, common::sqlite(), ROW);
conformance_suite!(sqlite_row_stale, common::sqlite(), ROW_STALE);
conformance_suite!(sqlite_lease, common::sqlite(), LEASE);

#[cfg(feature = "postgres")]
conformance_suite!(pg_row, common::pg(), ROW);
#[cfg(feature = "postgres")]
conformance_suite!(pg_row_stale, common::pg(), ROW_STALE);
#[cfg(feature = "postgres")]
conformance_suite!(pg_lease, common::pg(), LEASE);

#[cfg(feature = "postgres")]
conformance_suite!(pg_for_update, common::pg(), Strategy::ForUpdate);
#[cfg(feature = "postgres")]
conformance_suite!(pg_advisory, common::pg(), Strategy::Advisory);
#[cfg(feature = "postgres")]
conformance_suite!(pg_advisory_xact, common::pg(), Strategy::AdvisoryXact);

// Through a transaction-pooling PgBouncer: the strategies that work there (docs/guide.md, "Behind a
// connection pooler"). Session-level Advisory does not, and is not run.
#[cfg(feature = "postgres")]
conformance_suite!(pgbouncer_row, common::pgbouncer(), ROW);
#[cfg(feature = "postgres")]
conformance_suite!(pgbouncer_row_stale, common::pgbouncer(), ROW_STALE);
#[cfg(feature = "postgres")]
conformance_suite!(pgbouncer_lease, common::pgbouncer(), LEASE);
#[cfg(feature = "postgres")]
conformance_suite!(
    pgbouncer_for_update,
    common::pgbouncer(),
    Strategy::ForUpdate
);
#[cfg(feature = "postgres")]
conformance_suite!(
    pgbouncer_advisory_xact,
    common::pgbouncer(),
    Strategy::AdvisoryXact
);

#[cfg(feature = "mysql")]
conformance_suite!(mysql_row, common::mysql(), ROW);
#[cfg(feature = "mysql")]
conformance_suite!(mysql_row_stale, common::mysql(), ROW_STALE);
#[cfg(feature = "mysql")]
conformance_suite!(mysql_lease, common::mysql(), LEASE);
#[cfg(feature = "mysql")]
conformance_suite!(mysql_for_update, common::mysql(), Strategy::ForUpdate);
#[cfg(feature = "mysql")]
conformance_suite!(mysql_advisory, common::mysql(), Strategy::Advisory);
#[cfg(feature = "mysql")]
conformance_suite!(
    mysql_lease_simultaneous_assignment,
    common::mysql_simultaneous_assignment(),
    LEASE
);
