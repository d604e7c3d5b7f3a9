ALTER TABLE dlock_leases DROP COLUMN IF EXISTS line_free;
