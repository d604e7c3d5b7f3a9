-- Hand-over in the releasing transaction (Row and Lease): a waiter's place names the holder
-- id it will hold the key under (`holder`), chosen when it joins. A release that finds a
-- live place in the key's line gives the key to the first one in the same transaction (the
-- lease or row then carries that holder id, the key's next token and an expiry no later than
-- the place's own) and marks the place `granted_at`; the waiter confirms. A head that dies
-- before confirming loses the grant when its place lapses.
-- MySQL commits each DDL statement by itself, and MySQL 8 has no ADD COLUMN IF NOT EXISTS:
-- each column is added only if missing, so that a partial run can run again.
SET @dlock_ddl = (
    SELECT IF(COUNT(*) = 0, 'ALTER TABLE dlock_waiters ADD COLUMN holder VARCHAR(64) NULL', 'DO 0')
    FROM information_schema.COLUMNS
    WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'dlock_waiters' AND COLUMN_NAME = 'holder'
);
PREPARE dlock_stmt FROM @dlock_ddl;
EXECUTE dlock_stmt;
DEALLOCATE PREPARE dlock_stmt;
SET @dlock_ddl = (
    SELECT IF(COUNT(*) = 0, 'ALTER TABLE dlock_waiters ADD COLUMN granted_at DATETIME(6) NULL', 'DO 0')
    FROM information_schema.COLUMNS
    WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'dlock_waiters' AND COLUMN_NAME = 'granted_at'
);
PREPARE dlock_stmt FROM @dlock_ddl;
EXECUTE dlock_stmt;
DEALLOCATE PREPARE dlock_stmt;
