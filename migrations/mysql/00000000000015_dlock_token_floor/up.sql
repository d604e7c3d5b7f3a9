-- The token floor of Row and Lease keys (and the lease-based readers and permits), so that a
-- released key's rows can go: `purge` raises the floor to at least every counter it is
-- about to delete, and commits that, before it deletes them; a key without a counter row
-- takes its first token above the floor. 64 rows (the bucket is chosen by a hash of the key,
-- src/key.rs), all raised together by a purge: an acquisition reads its bucket's row with
-- LOCK IN SHARE MODE, which a purge's raise waits for (and the reverse), so it reads the
-- floor's newest value at any isolation level. See src/backend/mysql/locks.rs.
-- Every statement can run again over a half-done run (DDL commits at once on MySQL).
CREATE TABLE IF NOT EXISTS dlock_token_floor (
    bucket INT NOT NULL PRIMARY KEY,
    floor_token BIGINT NOT NULL
) ENGINE = InnoDB;
SET @dlock_floor = GREATEST((SELECT COALESCE(MAX(token), 0) FROM dlock_tokens),
                            (SELECT COALESCE(MAX(token), 0) FROM dlock_leases));
INSERT IGNORE INTO dlock_token_floor (bucket, floor_token) VALUES (0, 0), (1, 0), (2, 0), (3, 0), (4, 0), (5, 0), (6, 0), (7, 0), (8, 0), (9, 0), (10, 0), (11, 0), (12, 0), (13, 0), (14, 0), (15, 0), (16, 0), (17, 0), (18, 0), (19, 0), (20, 0), (21, 0), (22, 0), (23, 0), (24, 0), (25, 0), (26, 0), (27, 0), (28, 0), (29, 0), (30, 0), (31, 0), (32, 0), (33, 0), (34, 0), (35, 0), (36, 0), (37, 0), (38, 0), (39, 0), (40, 0), (41, 0), (42, 0), (43, 0), (44, 0), (45, 0), (46, 0), (47, 0), (48, 0), (49, 0), (50, 0), (51, 0), (52, 0), (53, 0), (54, 0), (55, 0), (56, 0), (57, 0), (58, 0), (59, 0), (60, 0), (61, 0), (62, 0), (63, 0);
UPDATE dlock_token_floor SET floor_token = GREATEST(floor_token, @dlock_floor);
