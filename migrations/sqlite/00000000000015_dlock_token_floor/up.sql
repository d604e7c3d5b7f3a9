-- The token floor of Row and Lease keys (and the lease-based readers and permits), so that a
-- released key's rows can go: `purge` raises the floor to at least every counter it is
-- about to delete before it deletes them; a key without a counter row takes its first token
-- above the floor. 64 rows as on the server backends (the bucket is chosen by a hash of the
-- key, src/key.rs); SQLite's single writer orders every acquisition and purge.
CREATE TABLE IF NOT EXISTS dlock_token_floor (
    bucket INTEGER NOT NULL PRIMARY KEY,
    floor_token INTEGER NOT NULL
);
INSERT OR IGNORE INTO dlock_token_floor (bucket, floor_token) VALUES (0, 0), (1, 0), (2, 0), (3, 0), (4, 0), (5, 0), (6, 0), (7, 0), (8, 0), (9, 0), (10, 0), (11, 0), (12, 0), (13, 0), (14, 0), (15, 0), (16, 0), (17, 0), (18, 0), (19, 0), (20, 0), (21, 0), (22, 0), (23, 0), (24, 0), (25, 0), (26, 0), (27, 0), (28, 0), (29, 0), (30, 0), (31, 0), (32, 0), (33, 0), (34, 0), (35, 0), (36, 0), (37, 0), (38, 0), (39, 0), (40, 0), (41, 0), (42, 0), (43, 0), (44, 0), (45, 0), (46, 0), (47, 0), (48, 0), (49, 0), (50, 0), (51, 0), (52, 0), (53, 0), (54, 0), (55, 0), (56, 0), (57, 0), (58, 0), (59, 0), (60, 0), (61, 0), (62, 0), (63, 0);
UPDATE dlock_token_floor SET floor_token = max(floor_token, (SELECT COALESCE(max(token), 0) FROM dlock_tokens),
                                                (SELECT COALESCE(max(token), 0) FROM dlock_leases));
