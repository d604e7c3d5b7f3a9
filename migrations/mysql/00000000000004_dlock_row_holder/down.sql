ALTER TABLE dlock_rows DROP COLUMN holder;
