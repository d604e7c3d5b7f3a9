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

-- The token is stamped by the database inside the INSERT: the counter row stays locked
-- until the inserting statement commits, so tokens follow insertion order.
CREATE TRIGGER IF NOT EXISTS dlock_rows_token BEFORE INSERT ON dlock_rows FOR EACH ROW
BEGIN
    INSERT INTO dlock_tokens (lock_key, token) VALUES (NEW.lock_key, 1)
        ON DUPLICATE KEY UPDATE token = token + 1;
    SET NEW.token = (SELECT token FROM dlock_tokens WHERE lock_key = NEW.lock_key);
END;

-- Strategy::Lease: one row per key, kept forever; holder/expires_at are NULL when free.
CREATE TABLE IF NOT EXISTS dlock_leases (
    lock_key VARBINARY(255) NOT NULL PRIMARY KEY,
    owner VARCHAR(255) NULL,
    holder VARCHAR(64) NULL,
    token BIGINT NOT NULL,
    acquired_at DATETIME(6) NULL,
    expires_at DATETIME(6) NULL
) ENGINE = InnoDB;
