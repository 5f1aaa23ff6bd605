-- Heartbeat: push back the lease of the heads this process runs; the keys back are the ones renewed.
UPDATE {schema}.order_jobs AS j
   SET expires_at = now() + %(lease_ms)s * interval '1 millisecond'
  FROM unnest(%(keys)s::text[], %(tokens)s::bigint[]) AS held (key, token)
 WHERE j.key = held.key AND j.token = held.token AND j.state = 'running'
RETURNING j.key
