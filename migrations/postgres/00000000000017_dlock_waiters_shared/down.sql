ALTER TABLE dlock_waiters DROP COLUMN IF EXISTS shared;
