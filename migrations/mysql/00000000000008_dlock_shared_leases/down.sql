DROP TABLE IF EXISTS dlock_shared_leases;
DROP TABLE IF EXISTS dlock_shared_keys;
