-- The line of waiters per key (Row and Lease): a waiter that finds the key held takes a
-- numbered place here and keeps it alive by renewing `expires_at` (database clock) while it
-- waits. The key goes to the lowest live place: nobody, not even a newcomer, takes a free
-- key while a live place is ahead of it. `channel`: the waiter's Locker LISTENs there, and
-- a release notifies only the first live place's channel. A place whose waiter died lapses
-- at `expires_at`; `since` is when its waiter began to wait.
CREATE TABLE IF NOT EXISTS dlock_waiters (
    id BIGSERIAL PRIMARY KEY,
    lock_key TEXT NOT NULL,
    owner TEXT NOT NULL,
    channel TEXT,
    since TIMESTAMPTZ NOT NULL,
    expires_at TIMESTAMPTZ NOT NULL
);
CREATE INDEX IF NOT EXISTS dlock_waiters_key ON dlock_waiters (lock_key, id);
