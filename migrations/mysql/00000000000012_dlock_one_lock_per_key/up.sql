-- One lock per key on Strategy::Lease: the exclusive lease excludes the key's readers and
-- permit holders, and they exclude it. The lease row of a key (dlock_leases) carries
-- `shared_until`, the latest expiry of the key's live readers and permits: the exclusive
-- acquire takes the row only once it has passed, and a shared acquisition locks the row,
-- raises it and draws its token from the row's counter (one token sequence per key).
--
-- `holder` becomes `holder_id` in both lease tables, so that a process built before this
-- migration fails on its lease statements ("Unknown column", which it reports as missing
-- tables) instead of taking an exclusive lease beside readers it cannot see. MySQL commits
-- each DDL statement by itself, so every step is written to be run again after a partial
-- run, and the renames go first: from then on no older process adds a holder, and the
-- last step sees every holder there is.
SET @dlock_ddl = (
    SELECT IF(COUNT(*) = 1, 'ALTER TABLE dlock_leases RENAME COLUMN holder TO holder_id', 'DO 0')
    FROM information_schema.COLUMNS
    WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'dlock_leases' AND COLUMN_NAME = 'holder'
);
PREPARE dlock_stmt FROM @dlock_ddl;
EXECUTE dlock_stmt;
DEALLOCATE PREPARE dlock_stmt;

SET @dlock_ddl = (
    SELECT IF(COUNT(*) = 1, 'ALTER TABLE dlock_shared_leases RENAME COLUMN holder TO holder_id', 'DO 0')
    FROM information_schema.COLUMNS
    WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'dlock_shared_leases' AND COLUMN_NAME = 'holder'
);
PREPARE dlock_stmt FROM @dlock_ddl;
EXECUTE dlock_stmt;
DEALLOCATE PREPARE dlock_stmt;

SET @dlock_ddl = (
    SELECT IF(COUNT(*) = 0, 'ALTER TABLE dlock_leases ADD COLUMN shared_until DATETIME(6) NULL', 'DO 0')
    FROM information_schema.COLUMNS
    WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'dlock_leases' AND COLUMN_NAME = 'shared_until'
);
PREPARE dlock_stmt FROM @dlock_ddl;
EXECUTE dlock_stmt;
DEALLOCATE PREPARE dlock_stmt;

-- Every key with readers, writers or permits gets a lease row whose counter continues
-- from the larger of the key's two counters until now (its header's, and the lease's or
-- the one a purge saved), and whose `shared_until` covers its live holders.
INSERT INTO dlock_leases (lock_key, token, acquired_at, shared_until)
SELECT k.lock_key,
       GREATEST(k.token, COALESCE((SELECT t.token FROM dlock_tokens t WHERE t.lock_key = k.lock_key), 0)),
       UTC_TIMESTAMP(6),
       (SELECT MAX(s.expires_at) FROM dlock_shared_leases s WHERE s.lock_key = k.lock_key)
FROM dlock_shared_keys k
ON DUPLICATE KEY UPDATE
    token = GREATEST(dlock_leases.token, VALUES(token)), shared_until = VALUES(shared_until);
