-- A key's name is not a lock: a `Row` lock, a `Lease` lock (its writers, readers and permits
-- together), a `ForUpdate` semaphore and an `Advisory` semaphore of one name are four locks,
-- and each has a line of its own. `line` says whose line a place is in (0 `Lease`, 1 `Row`,
-- 2 `ForUpdate` permits, 3 `Advisory` permits), and every statement of a line reads its
-- own places only: before it, a release handed a key to the first place of any of them (a
-- `Lease` release granting a `Row` waiter's place, which could not take it), and a waiter
-- of one held up the newcomers of the others. 0 by default: places of a build from before
-- this migration are in `Lease`'s line.
ALTER TABLE dlock_waiters ADD COLUMN line INTEGER NOT NULL DEFAULT 0;
