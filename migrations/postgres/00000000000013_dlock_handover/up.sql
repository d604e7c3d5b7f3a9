-- Hand-over in the releasing statement (Row and Lease): a waiter's place names the holder id
-- it will hold the key under (`holder`), chosen when it joins. A release that finds a live
-- place in the key's line gives the key to the first one in the same statement (the lease or
-- row then carries that holder id, the key's next token and an expiry no later than the
-- place's own) and marks the place `granted_at`; the waiter confirms (extends the expiry to
-- its own and removes its place). A head that dies before confirming loses the grant when
-- its place lapses.
ALTER TABLE dlock_waiters ADD COLUMN IF NOT EXISTS holder TEXT;
ALTER TABLE dlock_waiters ADD COLUMN IF NOT EXISTS granted_at TIMESTAMPTZ;
