-- When a ForUpdate key row and a key's kind were made: a purge takes only rows older than
-- its grace (`Locker::purge(idle)`) that nobody holds, so that a row is not deleted between
-- its creation and the acquisition that made it, and churn beside keys in use stays rare.
-- Rows there before this migration count from now. TIMESTAMP (stored in UTC, compared with
-- CURRENT_TIMESTAMP in the session's zone). MySQL commits each DDL statement by itself (and
-- has no ADD COLUMN IF NOT EXISTS): each column is added only when a partial run has not.
SET @dlock_ddl = (
    SELECT IF(COUNT(*) = 0, 'ALTER TABLE dlock_for_update ADD COLUMN created_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)', 'DO 0')
    FROM information_schema.COLUMNS
    WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'dlock_for_update' AND COLUMN_NAME = 'created_at'
);
PREPARE dlock_stmt FROM @dlock_ddl;
EXECUTE dlock_stmt;
DEALLOCATE PREPARE dlock_stmt;
SET @dlock_ddl = (
    SELECT IF(COUNT(*) = 0, 'ALTER TABLE dlock_shared_keys ADD COLUMN created_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)', 'DO 0')
    FROM information_schema.COLUMNS
    WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'dlock_shared_keys' AND COLUMN_NAME = 'created_at'
);
PREPARE dlock_stmt FROM @dlock_ddl;
EXECUTE dlock_stmt;
DEALLOCATE PREPARE dlock_stmt;
