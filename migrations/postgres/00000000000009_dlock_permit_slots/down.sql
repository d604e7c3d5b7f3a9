DROP TABLE IF EXISTS dlock_permit_slots;
