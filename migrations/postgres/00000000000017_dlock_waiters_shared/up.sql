-- Readers and semaphore permits wait in the key's line too: `shared` marks their places
-- (1) beside an exclusive waiter's (0, the default, so that statements written before this
-- migration join as exclusive waiters). A reader may be let in past the places of other
-- readers ahead of it, a permit past as many places ahead as there are free permits; no one
-- past an exclusive waiter's place.
ALTER TABLE dlock_waiters ADD COLUMN IF NOT EXISTS shared INTEGER NOT NULL DEFAULT 0;
