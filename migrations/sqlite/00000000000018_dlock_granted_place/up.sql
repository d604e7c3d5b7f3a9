-- A lease granted by a release to a waiter's place (dlock_waiters.granted_at) is taken by
-- its waiter with a read, and confirmed later by the holder's heartbeat, which removes the
-- place; a holder that lets the lease go first (a release, a hand-over to the next place)
-- leaves its place behind. It goes here, in the same statement as the change of holder: a
-- granted place of the lease's previous holder id is removed whenever the holder id changes
-- (released, handed on, taken over after expiry), so that no place of a finished grant is
-- left to look live to the line's counts. No write of its own: the statement that changes
-- the holder holds SQLite's write lock already.
CREATE TRIGGER IF NOT EXISTS dlock_leases_granted_place AFTER UPDATE OF holder_id ON dlock_leases
WHEN old.holder_id IS NOT NULL AND old.holder_id IS NOT new.holder_id
BEGIN
    DELETE FROM dlock_waiters
    WHERE lock_key = old.lock_key AND holder = old.holder_id AND granted_at IS NOT NULL;
END;
