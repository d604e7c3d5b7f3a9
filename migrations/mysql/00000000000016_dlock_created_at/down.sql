ALTER TABLE dlock_shared_keys DROP COLUMN created_at;
ALTER TABLE dlock_for_update DROP COLUMN created_at;
