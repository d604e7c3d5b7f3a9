-- The line of waiters per key (Row and Lease): a waiter that finds the key held takes a
-- numbered place here and keeps it alive by renewing `expires_at` (UTC text, as the other
-- tables) while it waits. The key goes to the lowest live place: nobody, not even a
-- newcomer, takes a free key while a live place is ahead of it. A place whose waiter died
-- lapses at `expires_at`; `since` is when its waiter began to wait. AUTOINCREMENT: a place
-- number is never handed out twice. (`channel` is PostgreSQL's; NULL here.)
CREATE TABLE IF NOT EXISTS dlock_waiters (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    lock_key TEXT NOT NULL,
    owner TEXT NOT NULL,
    channel TEXT,
    since TEXT NOT NULL,
    expires_at TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS dlock_waiters_key ON dlock_waiters (lock_key, id);
