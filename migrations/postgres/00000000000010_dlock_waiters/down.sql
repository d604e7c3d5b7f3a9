DROP TABLE IF EXISTS dlock_waiters;
