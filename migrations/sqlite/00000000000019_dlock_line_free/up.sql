-- A `Lease` key's row says whether nobody waits in the key's line (`line_free`), so that an
-- uncontended acquisition and release need not look into dlock_waiters. Every write holds
-- SQLite's one write lock: a join clears it in its own transaction, a release that finds no
-- live place sets it, and so does an acquisition's insert of a new row for a newcomer (its
-- look found nobody). 0 (look) by default, for rows written before this migration.
ALTER TABLE dlock_leases ADD COLUMN line_free INTEGER NOT NULL DEFAULT 0;
