DROP TABLE IF EXISTS dlock_fence_live;
DROP TABLE IF EXISTS dlock_fence;
