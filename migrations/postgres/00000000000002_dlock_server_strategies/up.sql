-- Strategy::ForUpdate: one row per key, kept forever. The holder's transaction locks it
-- (SELECT ... FOR UPDATE) and bumps `version`, which is the fencing token.
CREATE TABLE IF NOT EXISTS dlock_for_update (
    lock_key TEXT PRIMARY KEY,
    version BIGINT NOT NULL
);

-- optimistic::transaction: one version per key, bumped by every committed transaction.
CREATE TABLE IF NOT EXISTS dlock_versions (
    lock_key TEXT PRIMARY KEY,
    version BIGINT NOT NULL
);
