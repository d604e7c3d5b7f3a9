ALTER TABLE dlock_rows DROP COLUMN stale_at;
