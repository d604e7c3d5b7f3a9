-- When a ForUpdate key row and a key's kind were made: a purge takes only rows older than
-- its grace (`Locker::purge(idle)`) that nobody holds, so that a row is not deleted between
-- its creation and the acquisition that made it, and churn beside keys in use stays rare.
-- Rows there before this migration count from now.
ALTER TABLE dlock_for_update ADD COLUMN IF NOT EXISTS created_at TIMESTAMPTZ NOT NULL DEFAULT now();
ALTER TABLE dlock_shared_keys ADD COLUMN IF NOT EXISTS created_at TIMESTAMPTZ NOT NULL DEFAULT now();
