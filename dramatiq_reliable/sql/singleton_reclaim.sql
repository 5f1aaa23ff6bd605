-- Heartbeat: put back the lease of a run still going whose row is gone (its acquire was lost in a
-- Postgres crash), with its own token, when no one holds the key.  A key someone else holds, or a
-- lapsed row (a crash can bring one back), is not taken: that run's lease counts as lost.  The
-- quarantine keeps the key free for lease_ms after a crash, several heartbeats' time.
INSERT INTO {schema}.singleton_leases (key, token, message_id, owner, expires_at)
SELECT held.key, held.token, held.message_id, %(owner)s, now() + %(lease_ms)s * interval '1 millisecond'
FROM unnest(%(keys)s::text[], %(tokens)s::bigint[], %(message_ids)s::text[]) AS held (key, token, message_id)
WHERE set_config('synchronous_commit', 'on', true) IS NOT NULL
ON CONFLICT (key) DO NOTHING
RETURNING key
