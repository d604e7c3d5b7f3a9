-- Keys are VARBINARY so that they compare byte for byte: case-sensitive and without the
-- trailing-space padding of MySQL's PAD SPACE collations.

-- Per-key fencing counters: never deleted, so a key's token only grows.
CREATE TABLE IF NOT EXISTS dlock_tokens (
    lock_key VARBINARY(255) NOT NULL PRIMARY KEY,
    token BIGINT NOT NULL
) ENGINE = InnoDB;

-- Strategy::Row: a row exists while the key is held; release deletes it by id.
CREATE TABLE IF NOT EXISTS dlock_rows (
    id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
    lock_key VARBINARY(255) NOT NULL,
    owner VARCHAR(255) NOT NULL,
    token BIGINT NOT NULL DEFAULT 0,
    acquired_at DATETIME(6) NOT NULL,
    UNIQUE KEY dlock_rows_key (lock_key)
) ENGINE = InnoDB;

-- The token is drawn by the acquiring statements from dlock_tokens (src/backend/mysql/locks.rs).
-- Versions before 0.2 created a trigger here, which needs SUPER on a server with a binary
-- log; migration 11 drops it from a database created then.

-- Strategy::Lease: one row per key, kept forever; holder/expires_at are NULL when free.
CREATE TABLE IF NOT EXISTS dlock_leases (
    lock_key VARBINARY(255) NOT NULL PRIMARY KEY,
    owner VARCHAR(255) NULL,
    holder VARCHAR(64) NULL,
    token BIGINT NOT NULL,
    acquired_at DATETIME(6) NULL,
    expires_at DATETIME(6) NULL
) ENGINE = InnoDB;
