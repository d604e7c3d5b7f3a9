ALTER TABLE dlock_leases DROP COLUMN shared_until;
ALTER TABLE dlock_shared_leases RENAME COLUMN holder_id TO holder;
ALTER TABLE dlock_leases RENAME COLUMN holder_id TO holder;
