SET @dlock_ddl = (
    SELECT IF(COUNT(*) = 1, 'ALTER TABLE dlock_fence_live DROP COLUMN server', 'DO 0')
    FROM information_schema.COLUMNS
    WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'dlock_fence_live' AND COLUMN_NAME = 'server'
);
PREPARE dlock_stmt FROM @dlock_ddl;
EXECUTE dlock_stmt;
DEALLOCATE PREPARE dlock_stmt;
