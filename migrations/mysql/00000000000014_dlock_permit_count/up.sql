-- The number of permits of a key (0: a reader-writer key) is `permit_count` now. A process
-- built before migration 12 takes a ForUpdate or Advisory permit without the key's own lock
-- in shared mode, so it could hold a permit beside this version's exclusive holder of the
-- key: its permit statements read `permits`, and now fail ("Unknown column") instead.
-- MySQL commits each DDL statement by itself: the rename is skipped when a partial run has
-- done it already.
SET @dlock_ddl = (
    SELECT IF(COUNT(*) = 1, 'ALTER TABLE dlock_shared_keys RENAME COLUMN permits TO permit_count', 'DO 0')
    FROM information_schema.COLUMNS
    WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'dlock_shared_keys' AND COLUMN_NAME = 'permits'
);
PREPARE dlock_stmt FROM @dlock_ddl;
EXECUTE dlock_stmt;
DEALLOCATE PREPARE dlock_stmt;
