-- Readers and semaphore permits wait in the key's line too: `shared` marks their places
-- (1) beside an exclusive waiter's (0, the default, so that statements written before this
-- migration join as exclusive waiters). A reader may be let in past the places of other
-- readers ahead of it, a permit past as many places ahead as there are free permits; no one
-- past an exclusive waiter's place. MySQL commits each DDL statement by itself (and has no
-- ADD COLUMN IF NOT EXISTS): the column is added only when a partial run has not.
SET @dlock_ddl = (
    SELECT IF(COUNT(*) = 0, 'ALTER TABLE dlock_waiters ADD COLUMN shared INT NOT NULL DEFAULT 0', 'DO 0')
    FROM information_schema.COLUMNS
    WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'dlock_waiters' AND COLUMN_NAME = 'shared'
);
PREPARE dlock_stmt FROM @dlock_ddl;
EXECUTE dlock_stmt;
DEALLOCATE PREPARE dlock_stmt;
