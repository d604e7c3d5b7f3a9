-- Strategy::Row: a per-acquisition holder id beside the row, so that an acquirer that got an
-- error after its INSERT may have committed (a lost reply, a dropped connection) can delete
-- exactly its own row instead of leaving a lock nobody holds.
ALTER TABLE dlock_rows ADD COLUMN IF NOT EXISTS holder TEXT;
