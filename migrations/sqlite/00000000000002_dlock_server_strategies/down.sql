DROP TABLE IF EXISTS dlock_versions;
