-- The longest transaction open on this database now, other than ours: a job that runs inside
-- its transaction (transactional Idempotency) is one; so is a stuck one holding locks.
SELECT coalesce(max(extract(epoch FROM clock_timestamp() - xact_start)) * 1000, 0)::double precision
           AS longest_transaction_ms
FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid() AND xact_start IS NOT NULL
  AND backend_type = 'client backend'
