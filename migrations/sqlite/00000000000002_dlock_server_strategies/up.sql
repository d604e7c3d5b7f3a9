-- optimistic::transaction: one version per key, bumped by every committed transaction.
-- (SQLite has no row locks, so it has no dlock_for_update table.)
CREATE TABLE IF NOT EXISTS dlock_versions (
    lock_key TEXT NOT NULL PRIMARY KEY,
    version INTEGER NOT NULL
);
