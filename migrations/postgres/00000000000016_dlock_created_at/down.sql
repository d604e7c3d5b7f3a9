ALTER TABLE dlock_shared_keys DROP COLUMN IF EXISTS created_at;
ALTER TABLE dlock_for_update DROP COLUMN IF EXISTS created_at;
