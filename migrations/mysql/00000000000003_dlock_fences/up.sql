-- Strategy::ForUpdate fencing tokens. The holder's transaction is rolled back when the
-- holder dies, and so is anything it wrote, but an AUTO_INCREMENT value once drawn is never
-- drawn again (and InnoDB keeps the counter across restarts: MySQL 8, MariaDB 10.2.4+).
-- The holder inserts a row here, takes its id as the token, and deletes it before COMMIT;
-- while it exists, the row (visible only inside the holder's transaction) is the proof that
-- the transaction is still open.
CREATE TABLE IF NOT EXISTS dlock_fences (
    id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
    lock_key VARBINARY(255) NOT NULL
) ENGINE = InnoDB;

-- Start above every version issued before this migration, which were the tokens until then.
-- (IGNORE: a run killed between these two statements leaves the row; the next run goes on.)
INSERT IGNORE INTO dlock_fences (id, lock_key)
    SELECT COALESCE(MAX(version), 0) + 1, '' FROM dlock_for_update;
DELETE FROM dlock_fences WHERE lock_key = '';
