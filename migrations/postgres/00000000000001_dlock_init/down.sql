DROP TABLE IF EXISTS dlock_leases;
DROP TABLE IF EXISTS dlock_rows;
DROP TABLE IF EXISTS dlock_tokens;
