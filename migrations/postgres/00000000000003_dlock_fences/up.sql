-- Strategy::ForUpdate fencing tokens. The holder's transaction is rolled back when the
-- holder dies, and so is anything it wrote; a sequence is not transactional, so a token
-- drawn by a holder that then died is never handed out again. Start above every version
-- issued before this migration, which were the tokens until then.
CREATE SEQUENCE IF NOT EXISTS dlock_fence_seq;
SELECT setval('dlock_fence_seq',
              GREATEST((SELECT max(version) FROM dlock_for_update), 0) + 1, false);
