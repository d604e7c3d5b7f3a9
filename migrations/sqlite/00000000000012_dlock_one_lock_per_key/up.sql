-- One lock per key on Strategy::Lease: the exclusive lease excludes the key's readers and
-- permit holders, and they exclude it. The lease row of a key (dlock_leases) carries
-- `shared_until`, the latest expiry of the key's live readers and permits (UTC text, as
-- the other times): the exclusive acquire takes the row only once it has passed, and a
-- shared acquisition raises it and draws its token from the row's counter (one token
-- sequence per key).
--
-- `holder` becomes `holder_id` in both lease tables, so that a process built before this
-- migration fails on its lease statements ("no such column", which it reports as missing
-- tables) instead of taking an exclusive lease beside readers it cannot see.
ALTER TABLE dlock_leases RENAME COLUMN holder TO holder_id;
ALTER TABLE dlock_shared_leases RENAME COLUMN holder TO holder_id;
ALTER TABLE dlock_leases ADD COLUMN shared_until TEXT;

-- Every key with readers, writers or permits gets a lease row whose counter continues
-- from the larger of the key's two counters until now, and whose `shared_until` covers
-- its live holders.
INSERT INTO dlock_leases (lock_key, token, acquired_at, shared_until)
SELECT k.lock_key,
       max(k.token, COALESCE((SELECT t.token FROM dlock_tokens t WHERE t.lock_key = k.lock_key), 0)),
       strftime('%Y-%m-%d %H:%M:%f', 'now'),
       (SELECT max(s.expires_at) FROM dlock_shared_leases s WHERE s.lock_key = k.lock_key)
FROM dlock_shared_keys k WHERE true
ON CONFLICT (lock_key) DO UPDATE
    SET token = max(dlock_leases.token, excluded.token), shared_until = excluded.shared_until;
