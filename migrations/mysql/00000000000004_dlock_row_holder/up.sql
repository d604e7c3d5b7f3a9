-- Strategy::Row: a per-acquisition holder id beside the row, so that an acquirer that got an
-- error between its INSERT and reading the row back can delete exactly its own row instead
-- of leaving a lock nobody holds. (MySQL 8 has no ADD COLUMN IF NOT EXISTS; a migration runs
-- once.)
ALTER TABLE dlock_rows ADD COLUMN holder VARCHAR(64) NULL;
