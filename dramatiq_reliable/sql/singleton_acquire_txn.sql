-- Take the key inside the job's own transaction (transactional Idempotency): lock the key's
-- row, free by then (expires_at in the past), and write this run's token into it.  The row lock
-- is the lease: held exactly as long as the job's transaction, released by its commit or
-- rollback, or by Postgres when the worker's connection goes (a killed worker, a crash).
-- expires_at stays '-infinity', so the committed row is free again whatever the outcome.
--
-- Nothing here waits: a row locked by another job transaction is skipped (SKIP LOCKED), a live
-- lease of the autocommit path does not match, and a missing row is reported (present false)
-- rather than inserted: an uncommitted insert would make every other acquirer of the key wait
-- for this job.  token is NULL when the key is held or the leases are in quarantine.
WITH guard AS (
    SELECT quarantine_until, quarantine_until < now() AS open
    FROM {schema}.singleton_guard
    WHERE id = 1
), taken AS (
    UPDATE {schema}.singleton_leases AS lease
       SET token = nextval(%(tokens)s::regclass),
           message_id = %(message_id)s,
           owner = %(owner)s,
           acquired_at = now(),
           expires_at = '-infinity'
     WHERE lease.key IN (SELECT free.key
                           FROM {schema}.singleton_leases AS free
                          WHERE free.key = %(key)s
                            AND free.expires_at < now()
                            AND free.buffered_body IS NULL
                            AND coalesce((SELECT open FROM guard), false)
                            FOR UPDATE SKIP LOCKED)
    RETURNING lease.token
)
SELECT taken.token,
       EXISTS (SELECT 1 FROM {schema}.singleton_leases WHERE key = %(key)s) AS present,
       NOT coalesce((SELECT open FROM guard), false) AS quarantined,
       (SELECT CASE WHEN open THEN 0 ELSE ceil(extract(epoch FROM quarantine_until - now()) * 1000)::bigint END
         FROM guard) AS quarantine_left_ms
FROM (SELECT 1) AS one
LEFT JOIN taken ON true
