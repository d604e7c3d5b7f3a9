-- Fencing tokens of ForUpdate and Advisory, one source for both and for every key: the
-- sequence dlock_fence_seq plus the offset of the server's current life, handed out only
-- while at most `high`, a bound committed (and flushed) before any token above the previous
-- bound is handed out. A sequence value is not always durable when a client sees it (its
-- WAL record may be another session's, not yet flushed), so after a crash the sequence may
-- hand out values again; the offset makes every token of the new life exceed the bound of
-- the old one. See src/backend/pg/fence.rs.

-- The durable bound: every token ever handed out is at most `high`.
CREATE TABLE IF NOT EXISTS dlock_fence (
    id INT PRIMARY KEY CHECK (id = 1),
    high BIGINT NOT NULL
);

-- Start above every token issued before this migration: the per-key counters (Advisory
-- until now) and the sequence (ForUpdate until now).
INSERT INTO dlock_fence (id, high)
SELECT 1, GREATEST(
    (SELECT last_value FROM dlock_fence_seq),
    (SELECT COALESCE(max(token), 0) FROM dlock_tokens),
    (SELECT COALESCE(max(version), 0) FROM dlock_for_update))
ON CONFLICT (id) DO NOTHING;

-- The server's current life: UNLOGGED, so crash recovery empties it (a clean shutdown
-- keeps it, and the sequence with it). `off` is fixed once per life; `high` is the last
-- bound committed in this life, a copy the acquiring statements read.
CREATE UNLOGGED TABLE IF NOT EXISTS dlock_fence_live (
    id INT PRIMARY KEY CHECK (id = 1),
    off BIGINT NOT NULL,
    high BIGINT NOT NULL
);
