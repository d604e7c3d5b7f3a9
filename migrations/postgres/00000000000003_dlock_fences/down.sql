DROP SEQUENCE IF EXISTS dlock_fence_seq;
