-- Strategy::Row: a per-acquisition holder id beside the row, so that an acquirer that got an
-- error between its INSERT and reading the row back can delete exactly its own row instead
-- of leaving a lock nobody holds.
-- A migration killed after this DDL committed (DDL commits at once on MySQL) but before
-- diesel recorded it must be able to run again: the column is added only if missing (MySQL 8
-- has no ADD COLUMN IF NOT EXISTS, so the statement is chosen by a query, both servers).
SET @dlock_ddl = (
    SELECT IF(COUNT(*) = 0, 'ALTER TABLE dlock_rows ADD COLUMN holder VARCHAR(64) NULL', 'DO 0')
    FROM information_schema.COLUMNS
    WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'dlock_rows' AND COLUMN_NAME = 'holder'
);
PREPARE dlock_stmt FROM @dlock_ddl;
EXECUTE dlock_stmt;
DEALLOCATE PREPARE dlock_stmt;
