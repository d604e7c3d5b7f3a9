//! The library's own SQL texts, for the benches' raw floors (`benches/support/raw.rs`): a
//! floor issues exactly the statements the library issues, never a copy that can drift.
//! Exposed as `diesel_lock::__bench_sql`, hidden and outside the API: the texts change
//! whenever the library's SQL does. Parameters are `?`, bound in the order they appear.

/// The place number a statement is given for a caller with no place in a key's line.
pub const NO_PLACE: i64 = crate::backend::NO_PLACE;

/// Statements that are the same on several backends.
pub mod shared {
    pub use crate::backend::shared::{LEASE_RELEASE, ROW_RELEASE};
}

/// PostgreSQL's statements.
#[cfg(feature = "postgres")]
pub mod pg {
    pub use crate::backend::pg::locks::{
        LEASE_ACQUIRE, LEASE_RELEASE, LEASE_RELEASE_ALONE, LEASE_TAKE, ROW_ACQUIRE, ROW_RELEASE,
        ROW_RELEASE_ALONE,
    };
    pub use crate::backend::pg::sessions::{
        ADVISORY_LOCK, ADVISORY_UNLOCK, ADVISORY_XACT_LOCK, FOR_UPDATE_LOCK,
    };
}

/// MySQL's and MariaDB's statements.
#[cfg(feature = "mysql")]
pub mod mysql {
    pub use crate::backend::mysql::handover::{
        LEASE_FIRST_PLACE, LEASE_RELEASE_ALONE, ROW_FIRST_PLACE, ROW_RELEASE_ALONE,
    };
    pub use crate::backend::mysql::locks::{
        LEASE_READ_BACK, LEASE_UPSERT, ROW_BUMP, ROW_INSERT, ROW_READ_BACK,
    };
    pub use crate::backend::mysql::sessions::{
        ADVISORY_LOCK, ADVISORY_UNLOCK, FOR_UPDATE_LOCK, FOR_UPDATE_LOCK_ONLY, GET_LOCK,
    };
    pub use crate::backend::shared::{LEASE_RELEASE, ROW_RELEASE};
}

/// SQLite's statements.
#[cfg(feature = "sqlite")]
pub mod sqlite {
    pub use crate::backend::shared::{LEASE_RELEASE, ROW_RELEASE};
    pub use crate::backend::sqlite::locks::{
        LEASE_ACQUIRE, LEASE_RELEASE_ALONE, ROW_ACQUIRE, ROW_RELEASE_ALONE,
    };
}
