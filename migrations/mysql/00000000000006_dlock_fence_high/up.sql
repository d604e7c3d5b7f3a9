-- Fencing tokens of ForUpdate and Advisory, one source for both and for every key:
-- UUID_SHORT() (a server-wide counter that increases while the server runs) plus the
-- offset of the server's current life, handed out only while at most a bound committed
-- before any token above the previous bound was handed out. See src/backend/mysql/fence.rs.
-- Every statement can run again over a half-done run (DDL commits at once on MySQL).

-- The durable bound: every token ever handed out is at most `high`.
CREATE TABLE IF NOT EXISTS dlock_fence (
    id INT NOT NULL PRIMARY KEY,
    high BIGINT NOT NULL
) ENGINE = InnoDB;

-- MySQL 8 caches information_schema's AUTO_INCREMENT for a day unless told not to.
SET @dlock_ddl = IF(VERSION() LIKE '%MariaDB%', 'DO 0',
                    'SET SESSION information_schema_stats_expiry = 0');
PREPARE dlock_stmt FROM @dlock_ddl;
EXECUTE dlock_stmt;
DEALLOCATE PREPARE dlock_stmt;

-- Start above every token issued before this migration: the per-key counters (Advisory
-- until now) and the AUTO_INCREMENT of dlock_fences (ForUpdate until now).
INSERT IGNORE INTO dlock_fence (id, high)
SELECT 1, GREATEST(
    (SELECT COALESCE(MAX(token), 0) FROM dlock_tokens),
    (SELECT COALESCE(MAX(version), 0) FROM dlock_for_update),
    (SELECT COALESCE(MAX(AUTO_INCREMENT), 0) FROM information_schema.TABLES
     WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'dlock_fences'));

-- The server's current life: MEMORY, so every restart empties it. `off` is fixed once per
-- life. Sessions read it once (a MEMORY table is locked whole for each statement, so no
-- statement that may wait for a lock reads it).
CREATE TABLE IF NOT EXISTS dlock_fence_live (
    id INT NOT NULL PRIMARY KEY,
    off BIGINT NOT NULL
) ENGINE = MEMORY;
