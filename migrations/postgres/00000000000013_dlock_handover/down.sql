ALTER TABLE dlock_waiters DROP COLUMN IF EXISTS granted_at;
ALTER TABLE dlock_waiters DROP COLUMN IF EXISTS holder;
