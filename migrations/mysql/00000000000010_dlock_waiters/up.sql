-- The line of waiters per key (Row and Lease): a waiter that finds the key held takes a
-- numbered place here and keeps it alive by renewing `expires_at` (database clock, UTC) while
-- it waits. The key goes to the lowest live place: nobody, not even a newcomer, takes a free
-- key while a live place is ahead of it. A place whose waiter died lapses at `expires_at`;
-- `since` is when its waiter began to wait. (`channel` is PostgreSQL's; NULL here.)
CREATE TABLE IF NOT EXISTS dlock_waiters (
    id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
    lock_key VARBINARY(255) NOT NULL,
    owner VARCHAR(255) NOT NULL,
    channel VARCHAR(64) NULL,
    since DATETIME(6) NOT NULL,
    expires_at DATETIME(6) NOT NULL,
    KEY dlock_waiters_key (lock_key, id)
) ENGINE = InnoDB;
