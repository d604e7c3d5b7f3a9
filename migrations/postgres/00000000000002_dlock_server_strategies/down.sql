DROP TABLE IF EXISTS dlock_versions;
DROP TABLE IF EXISTS dlock_for_update;
