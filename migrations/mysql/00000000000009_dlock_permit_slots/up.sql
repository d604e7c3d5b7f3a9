-- Semaphores of Strategy::ForUpdate: one row per permit of a key (slot 0 to N - 1, N kept
-- in the key's dlock_shared_keys row), created with the key and kept. A holder's transaction
-- locks a free one (FOR UPDATE SKIP LOCKED, MariaDB 10.6 and MySQL 8).
CREATE TABLE IF NOT EXISTS dlock_permit_slots (
    lock_key VARBINARY(255) NOT NULL,
    slot INT NOT NULL,
    PRIMARY KEY (lock_key, slot)
) ENGINE = InnoDB;
