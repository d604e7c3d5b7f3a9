ALTER TABLE dlock_waiters DROP COLUMN line;
