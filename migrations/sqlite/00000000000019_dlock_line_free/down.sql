ALTER TABLE dlock_leases DROP COLUMN line_free;
