-- A key's name is not a lock: a `Row` lock, a `Lease` lock (its writers, readers and permits
-- together), a `ForUpdate` semaphore and an `Advisory` semaphore of one name are four locks,
-- and each has a line of its own. `line` says whose line a place is in (0 `Lease`, 1 `Row`,
-- 2 `ForUpdate` permits, 3 `Advisory` permits), and every statement of a line reads its
-- own places only: before it, a release handed a key to the first place of any of them (a
-- `Lease` release granting a `Row` waiter's place, which could not take it), and a waiter
-- of one held up the newcomers of the others. 0 by default: places of a build from before
-- this migration are in `Lease`'s line.
ALTER TABLE dlock_waiters ADD COLUMN IF NOT EXISTS line SMALLINT NOT NULL DEFAULT 0;
-- The line's statements find a key's places by the key, the line and the place's number:
-- the index leads with all three, so that the line is an index condition. With `line` a
-- filter beside the old index (lock_key, id), the planner took the turn checks for a bitmap
-- scan of the key's whole index range (an estimate of one row), which reads every dead place
-- since the last vacuum and never marks them dead for the next scans to skip, as a plain
-- index scan does (see `lease_update!` in `locks.rs`).
CREATE INDEX IF NOT EXISTS dlock_waiters_line_key ON dlock_waiters (lock_key, line, id);
DROP INDEX IF EXISTS dlock_waiters_key;
