SET @dlock_ddl = (
    SELECT IF(COUNT(*) = 1, 'ALTER TABLE dlock_leases DROP COLUMN shared_until', 'DO 0')
    FROM information_schema.COLUMNS
    WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'dlock_leases' AND COLUMN_NAME = 'shared_until'
);
PREPARE dlock_stmt FROM @dlock_ddl;
EXECUTE dlock_stmt;
DEALLOCATE PREPARE dlock_stmt;

SET @dlock_ddl = (
    SELECT IF(COUNT(*) = 1, 'ALTER TABLE dlock_shared_leases RENAME COLUMN holder_id TO holder', 'DO 0')
    FROM information_schema.COLUMNS
    WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'dlock_shared_leases' AND COLUMN_NAME = 'holder_id'
);
PREPARE dlock_stmt FROM @dlock_ddl;
EXECUTE dlock_stmt;
DEALLOCATE PREPARE dlock_stmt;

SET @dlock_ddl = (
    SELECT IF(COUNT(*) = 1, 'ALTER TABLE dlock_leases RENAME COLUMN holder_id TO holder', 'DO 0')
    FROM information_schema.COLUMNS
    WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'dlock_leases' AND COLUMN_NAME = 'holder_id'
);
PREPARE dlock_stmt FROM @dlock_ddl;
EXECUTE dlock_stmt;
DEALLOCATE PREPARE dlock_stmt;
