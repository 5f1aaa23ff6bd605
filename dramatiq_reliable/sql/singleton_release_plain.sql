-- The common release, one autocommit statement: the lease this run holds, when nothing is buffered.
-- A release lost in a Postgres crash only leaves the lease to lapse after lease_ms, so this commit
-- does not wait for the WAL flush (synchronous_commit off for this statement's transaction alone).
DELETE FROM {schema}.singleton_leases
 WHERE key = %(key)s AND token = %(token)s AND buffered_body IS NULL
   AND set_config('synchronous_commit', 'off', true) IS NOT NULL
RETURNING key
