-- Per-key fencing counters: never deleted, so a key's token only grows.
CREATE TABLE IF NOT EXISTS dlock_tokens (
    lock_key TEXT NOT NULL PRIMARY KEY,
    token INTEGER NOT NULL
);

-- Strategy::Row: a row exists while the key is held; release deletes it by id.
-- Times are UTC text 'YYYY-MM-DD HH:MM:SS.SSS', which sorts as it compares.
CREATE TABLE IF NOT EXISTS dlock_rows (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    lock_key TEXT NOT NULL UNIQUE,
    owner TEXT NOT NULL,
    token INTEGER NOT NULL,
    acquired_at TEXT NOT NULL
);

CREATE TRIGGER IF NOT EXISTS dlock_rows_token AFTER INSERT ON dlock_rows
BEGIN
    INSERT INTO dlock_tokens (lock_key, token) VALUES (NEW.lock_key, NEW.token)
        ON CONFLICT (lock_key) DO UPDATE SET token = excluded.token;
END;

-- Strategy::Lease: one row per key, kept forever; holder/expires_at are NULL when free.
CREATE TABLE IF NOT EXISTS dlock_leases (
    lock_key TEXT NOT NULL PRIMARY KEY,
    owner TEXT,
    holder TEXT,
    token INTEGER NOT NULL,
    acquired_at TEXT,
    expires_at TEXT
);
