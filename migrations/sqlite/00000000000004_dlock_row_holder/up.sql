-- Strategy::Row: a per-acquisition holder id beside the row, so that an acquirer that got an
-- error after its INSERT may have committed can delete exactly its own row.
ALTER TABLE dlock_rows ADD COLUMN holder TEXT;
