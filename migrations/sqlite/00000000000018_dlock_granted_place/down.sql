DROP TRIGGER IF EXISTS dlock_leases_granted_place;
