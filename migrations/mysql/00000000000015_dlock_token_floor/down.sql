DROP TABLE IF EXISTS dlock_token_floor;
