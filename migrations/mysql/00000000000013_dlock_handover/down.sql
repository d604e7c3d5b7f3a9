ALTER TABLE dlock_waiters DROP COLUMN granted_at;
ALTER TABLE dlock_waiters DROP COLUMN holder;
