-- Take the key inside the job's own transaction (transactional Idempotency): lock the key's
-- row, free by then (expires_at in the past), and take a new fencing token.  The row lock is
-- the lease: held exactly as long as the job's transaction, released by its commit or
-- rollback, or by Postgres when the worker's connection goes (a killed worker, a crash).
-- The row is locked, not updated: it stays free (expires_at '-infinity') whatever the job's
-- outcome, and a key run thousands of times a minute leaves no dead row versions behind for
-- every later look-up to step over.  The token is not stored: the sequence alone makes it
-- larger than every earlier one, and the autocommit path takes its own from the same sequence.
--
-- Nothing here waits: a row locked by another job transaction is skipped (SKIP LOCKED), a live
-- lease of the autocommit path does not match, and a missing row is reported (present false)
-- rather than inserted: an uncommitted insert would make every other acquirer of the key wait
-- for this job.  token is NULL when the key is held or the leases are in quarantine.
WITH guard AS (
    SELECT quarantine_until, quarantine_until < now() AS open
    FROM {schema}.singleton_guard
    WHERE id = 1
), locked AS (
    SELECT lease.key
    FROM {schema}.singleton_leases AS lease
    WHERE lease.key = %(key)s
      AND lease.expires_at < now()
      AND lease.buffered_body IS NULL
      AND coalesce((SELECT open FROM guard), false)
    FOR UPDATE SKIP LOCKED
)
SELECT CASE WHEN locked.key IS NOT NULL THEN nextval(%(tokens)s::regclass) END AS token,
       locked.key IS NOT NULL OR EXISTS (SELECT 1 FROM {schema}.singleton_leases WHERE key = %(key)s) AS present,
       NOT coalesce((SELECT open FROM guard), false) AS quarantined,
       (SELECT CASE WHEN open THEN 0 ELSE ceil(extract(epoch FROM quarantine_until - now()) * 1000)::bigint END
         FROM guard) AS quarantine_left_ms
FROM (SELECT 1) AS one
LEFT JOIN locked ON true
