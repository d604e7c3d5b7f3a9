-- The token floor of Row and Lease keys (and the lease-based readers and permits), so that a
-- released key's rows can go: `purge` raises the floor to at least every counter it is
-- about to delete, and commits that, before it deletes them; a key without a counter row
-- takes its first token above the floor. 64 rows (the bucket is chosen by a hash of the key,
-- src/key.rs), all raised together by a purge: a key's first acquisition locks its bucket's
-- row FOR SHARE, which a purge's raise waits for (and the reverse), so the acquisition reads
-- the floor's newest value whatever its snapshot. See src/backend/pg/locks.rs.
CREATE TABLE IF NOT EXISTS dlock_token_floor (
    bucket INT PRIMARY KEY,
    floor_token BIGINT NOT NULL
);
-- Start at the highest counter there is, which every counter a purge may delete later
-- exceeds or was raised into the floor by that purge.
INSERT INTO dlock_token_floor (bucket, floor_token)
SELECT b, GREATEST((SELECT COALESCE(max(token), 0) FROM dlock_tokens),
                   (SELECT COALESCE(max(token), 0) FROM dlock_leases))
FROM generate_series(0, 63) AS b
ON CONFLICT (bucket) DO NOTHING;
