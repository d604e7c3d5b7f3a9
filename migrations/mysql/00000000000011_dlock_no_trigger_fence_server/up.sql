-- Versions before 0.2 stamped Row tokens with a trigger (migration 1 made it). The acquiring
-- statements now draw the token themselves; where the trigger is still there they let it
-- stamp the token (src/backend/mysql/locks.rs). It is dropped here where this user may: on a
-- server with a binary log, DROP TRIGGER (even IF EXISTS) needs SUPER or
-- log_bin_trust_function_creators, which this migration must not require.
SET @dlock_ddl = (
    SELECT IF(COUNT(*) > 0 AND (@@log_bin = 0 OR @@log_bin_trust_function_creators = 1
                                OR EXISTS (SELECT 1 FROM information_schema.USER_PRIVILEGES
                                           WHERE PRIVILEGE_TYPE = 'SUPER'
                                             AND GRANTEE = CONCAT('''', SUBSTRING_INDEX(CURRENT_USER(), '@', 1),
                                                                  '''@''', SUBSTRING_INDEX(CURRENT_USER(), '@', -1), ''''))),
              'DROP TRIGGER dlock_rows_token', 'DO 0')
    FROM information_schema.TRIGGERS
    WHERE TRIGGER_SCHEMA = DATABASE() AND TRIGGER_NAME = 'dlock_rows_token'
);
PREPARE dlock_stmt FROM @dlock_ddl;
EXECUTE dlock_stmt;
DEALLOCATE PREPARE dlock_stmt;

SET @dlock_ddl = (
    SELECT IF(COUNT(*) = 0, 'ALTER TABLE dlock_fence_live ADD COLUMN server BIGINT NULL', 'DO 0')
    FROM information_schema.COLUMNS
    WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'dlock_fence_live' AND COLUMN_NAME = 'server'
);
PREPARE dlock_stmt FROM @dlock_ddl;
EXECUTE dlock_stmt;
DEALLOCATE PREPARE dlock_stmt;
