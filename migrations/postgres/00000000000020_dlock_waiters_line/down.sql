CREATE INDEX IF NOT EXISTS dlock_waiters_key ON dlock_waiters (lock_key, id);
DROP INDEX IF EXISTS dlock_waiters_line_key;
ALTER TABLE dlock_waiters DROP COLUMN IF EXISTS line;
