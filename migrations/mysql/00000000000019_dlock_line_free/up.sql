-- A `Lease` key's row says whether nobody waits in the key's line (`line_free`), so that an
-- uncontended acquisition need not count the places ahead and its release need not read
-- the line (with next-key locks). Set only by a release that reads no live place with a
-- locking read; cleared by every join once its place is written. 0 (read the line) by
-- default, for rows written before this migration and by an acquisition's insert.
ALTER TABLE dlock_leases ADD COLUMN IF NOT EXISTS line_free TINYINT NOT NULL DEFAULT 0;
