-- The server whose life a dlock_fence_live row is (its @@server_id): a promoted replica, which
-- has the old primary's row, starts a life of its own. See src/backend/mysql/fence.rs.
-- A migration killed after this DDL committed (DDL commits at once on MySQL) but before
-- diesel recorded it must be able to run again: the column is added only if missing (MySQL 8
-- has no ADD COLUMN IF NOT EXISTS, so the statement is chosen by a query, both servers).
SET @dlock_ddl = (
    SELECT IF(COUNT(*) = 0, 'ALTER TABLE dlock_fence_live ADD COLUMN server BIGINT NULL', 'DO 0')
    FROM information_schema.COLUMNS
    WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'dlock_fence_live' AND COLUMN_NAME = 'server'
);
PREPARE dlock_stmt FROM @dlock_ddl;
EXECUTE dlock_stmt;
DEALLOCATE PREPARE dlock_stmt;
