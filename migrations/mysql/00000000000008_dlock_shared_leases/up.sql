-- Shared (reader-writer) leases and semaphore permits: one header row per key, kept
-- forever (it carries the key's kind and its token counter), and one row per holder.

-- `permits`: 0 for a reader-writer key, N for a semaphore of N permits; fixed by the first
-- acquisition. `token`: the last fencing token issued for the key. `intent`/`intent_until`:
-- a writer waiting for the readers to leave; no new reader gets in while it is live.
CREATE TABLE IF NOT EXISTS dlock_shared_keys (
    lock_key VARBINARY(255) NOT NULL PRIMARY KEY,
    permits BIGINT NOT NULL,
    token BIGINT NOT NULL,
    intent VARCHAR(128) NULL,
    intent_until DATETIME(6) NULL
) ENGINE = InnoDB;

-- One row per holder: `mode` is 'read', 'write' or 'permit'; expiry on the database clock.
CREATE TABLE IF NOT EXISTS dlock_shared_leases (
    lock_key VARBINARY(255) NOT NULL,
    holder VARCHAR(64) NOT NULL,
    owner VARCHAR(255) NOT NULL,
    mode VARCHAR(8) NOT NULL,
    token BIGINT NOT NULL,
    acquired_at DATETIME(6) NOT NULL,
    expires_at DATETIME(6) NOT NULL,
    PRIMARY KEY (lock_key, holder)
) ENGINE = InnoDB;
