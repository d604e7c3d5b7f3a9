-- The number of permits of a key (0: a reader-writer key) is `permit_count` now. A process
-- built before migration 12 takes a ForUpdate or Advisory permit without the key's own lock
-- in shared mode, so it could hold a permit beside this version's exclusive holder of the
-- key: its permit statements read `permits`, and now fail ("no such column", which it
-- reports as missing tables) instead.
ALTER TABLE dlock_shared_keys RENAME COLUMN permits TO permit_count;
