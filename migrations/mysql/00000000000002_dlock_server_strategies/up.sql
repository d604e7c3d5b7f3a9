-- Keys are VARBINARY so that they compare byte for byte, as in the first migration.

-- Strategy::ForUpdate: one row per key, kept forever. The holder's transaction locks it
-- (SELECT ... FOR UPDATE) and bumps `version`, which is the fencing token.
CREATE TABLE IF NOT EXISTS dlock_for_update (
    lock_key VARBINARY(255) NOT NULL PRIMARY KEY,
    version BIGINT NOT NULL
) ENGINE = InnoDB;

-- optimistic::transaction: one version per key, bumped by every committed transaction.
CREATE TABLE IF NOT EXISTS dlock_versions (
    lock_key VARBINARY(255) NOT NULL PRIMARY KEY,
    version BIGINT NOT NULL
) ENGINE = InnoDB;
