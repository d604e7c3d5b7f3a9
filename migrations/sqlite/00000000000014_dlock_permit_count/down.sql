ALTER TABLE dlock_shared_keys RENAME COLUMN permit_count TO permits;
