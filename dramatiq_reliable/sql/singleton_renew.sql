-- Heartbeat: push back the expiry of every lease this process still holds; the keys back are the ones renewed.
UPDATE {schema}.singleton_leases AS lease
   SET expires_at = now() + %(lease_ms)s * interval '1 millisecond'
  FROM unnest(%(keys)s::text[], %(tokens)s::bigint[]) AS held (key, token)
 WHERE lease.key = held.key AND lease.token = held.token
RETURNING lease.key
