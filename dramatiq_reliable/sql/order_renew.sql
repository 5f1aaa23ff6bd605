-- Heartbeat: push back the lease of the keys whose heads this process runs; the keys back are the ones renewed.
UPDATE {schema}.order_keys AS o
   SET expires_at = now() + %(lease_ms)s * interval '1 millisecond'
  FROM unnest(%(keys)s::text[], %(tokens)s::bigint[]) AS held (key, token)
 WHERE o.key = held.key AND o.token = held.token
RETURNING o.key
