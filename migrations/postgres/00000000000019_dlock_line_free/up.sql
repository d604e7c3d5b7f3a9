-- A `Lease` key's row says whether nobody waits in the key's line (`line_free`), so that an
-- uncontended acquisition and release need not look into dlock_waiters. Only a release that
-- found no live place sets it, and only if no place joined since its snapshot: every join
-- counts itself on the row (`line_joins`) as it clears `line_free`. False (look) by default,
-- for rows written before this migration and by statements that do not know of it.
ALTER TABLE dlock_leases ADD COLUMN IF NOT EXISTS line_free BOOLEAN NOT NULL DEFAULT false;
ALTER TABLE dlock_leases ADD COLUMN IF NOT EXISTS line_joins BIGINT NOT NULL DEFAULT 0;
