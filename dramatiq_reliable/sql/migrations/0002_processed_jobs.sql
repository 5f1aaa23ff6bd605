-- processed jobs (Idempotency): filled in by the idempotency work
SELECT 1;
