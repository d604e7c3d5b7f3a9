DROP TABLE IF EXISTS dlock_fences;
