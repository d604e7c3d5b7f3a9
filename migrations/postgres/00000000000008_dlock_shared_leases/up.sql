-- Shared (reader-writer) leases and semaphore permits: one header row per key, kept
-- forever (it carries the key's kind and its token counter), and one row per holder.

-- `permits`: 0 for a reader-writer key, N for a semaphore of N permits; fixed by the first
-- acquisition. `token`: the last fencing token issued for the key. `intent`/`intent_until`:
-- a writer waiting for the readers to leave; no new reader gets in while it is live.
CREATE TABLE IF NOT EXISTS dlock_shared_keys (
    lock_key TEXT PRIMARY KEY,
    permits BIGINT NOT NULL,
    token BIGINT NOT NULL,
    intent TEXT,
    intent_until TIMESTAMPTZ
);

-- One row per holder: `mode` is 'read', 'write' or 'permit'; expiry on the database clock.
CREATE TABLE IF NOT EXISTS dlock_shared_leases (
    lock_key TEXT NOT NULL,
    holder TEXT NOT NULL,
    owner TEXT NOT NULL,
    mode TEXT NOT NULL,
    token BIGINT NOT NULL,
    acquired_at TIMESTAMPTZ NOT NULL,
    expires_at TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (lock_key, holder)
);
