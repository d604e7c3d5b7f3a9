-- Per-key fencing counters: never deleted, so a key's token only grows.
CREATE TABLE IF NOT EXISTS dlock_tokens (
    lock_key TEXT PRIMARY KEY,
    token BIGINT NOT NULL
);

-- Strategy::Row: a row exists while the key is held; release deletes it by id.
CREATE TABLE IF NOT EXISTS dlock_rows (
    id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    lock_key TEXT NOT NULL UNIQUE,
    owner TEXT NOT NULL,
    token BIGINT NOT NULL,
    acquired_at TIMESTAMPTZ NOT NULL
);

-- Strategy::Lease: one row per key, kept forever; holder/expires_at are NULL when free.
CREATE TABLE IF NOT EXISTS dlock_leases (
    lock_key TEXT PRIMARY KEY,
    owner TEXT,
    holder TEXT,
    token BIGINT NOT NULL,
    acquired_at TIMESTAMPTZ,
    expires_at TIMESTAMPTZ
);
