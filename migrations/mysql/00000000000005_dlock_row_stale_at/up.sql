-- Strategy::Row: when the row goes stale, fixed by the Locker that inserted it (its
-- `stale_after` added to the insert time, database clock); NULL: never. Take-overs and
-- `purge` go by this, never by the caller's own setting, so a Locker with a short
-- `stale_after` cannot remove a row whose holder asked for a longer one, or for none.
-- Rows inserted before this migration have NULL: they never go stale.
-- A migration killed after this DDL committed (DDL commits at once on MySQL) but before
-- diesel recorded it must be able to run again: the column is added only if missing (MySQL 8
-- has no ADD COLUMN IF NOT EXISTS, so the statement is chosen by a query, both servers).
SET @dlock_ddl = (
    SELECT IF(COUNT(*) = 0, 'ALTER TABLE dlock_rows ADD COLUMN stale_at DATETIME(6) NULL', 'DO 0')
    FROM information_schema.COLUMNS
    WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'dlock_rows' AND COLUMN_NAME = 'stale_at'
);
PREPARE dlock_stmt FROM @dlock_ddl;
EXECUTE dlock_stmt;
DEALLOCATE PREPARE dlock_stmt;
