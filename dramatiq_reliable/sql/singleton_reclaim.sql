-- Heartbeat: put back the lease of a run still going whose row is gone or older than its own
-- (its acquire, or its takeover of a lapsed lease, was lost in a Postgres crash), with its own
-- token.  Only a missing row or a lapsed one with a smaller token is taken: a key held by a live
-- lease, or by a later holder (a larger token), is not, and that run's lease counts as lost.  The
-- quarantine keeps the key free for lease_ms after a crash, several heartbeats' time.
INSERT INTO {schema}.singleton_leases AS lease (key, token, message_id, owner, expires_at)
SELECT held.key, held.token, held.message_id, %(owner)s, now() + %(lease_ms)s * interval '1 millisecond'
FROM unnest(%(keys)s::text[], %(tokens)s::bigint[], %(message_ids)s::text[]) AS held (key, token, message_id)
WHERE set_config('synchronous_commit', 'on', true) IS NOT NULL
ON CONFLICT (key) DO UPDATE
   SET token = EXCLUDED.token,
       message_id = EXCLUDED.message_id,
       owner = EXCLUDED.owner,
       acquired_at = now(),
       expires_at = EXCLUDED.expires_at
 WHERE lease.expires_at < now() AND lease.token < EXCLUDED.token
RETURNING lease.key
