-- Strategy::Row: when the row goes stale, fixed by the Locker that inserted it (its
-- `stale_after` added to the insert time, database clock); NULL: never. Take-overs and
-- `purge` go by this, never by the caller's own setting, so a Locker with a short
-- `stale_after` cannot remove a row whose holder asked for a longer one, or for none.
-- Rows inserted before this migration have NULL: they never go stale.
ALTER TABLE dlock_rows ADD COLUMN stale_at DATETIME(6) NULL;
