DROP TABLE IF EXISTS dlock_leases;
DROP TRIGGER IF EXISTS dlock_rows_token;
DROP TABLE IF EXISTS dlock_rows;
DROP TABLE IF EXISTS dlock_tokens;
