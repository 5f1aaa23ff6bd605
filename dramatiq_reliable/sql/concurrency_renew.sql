-- Heartbeat: push back the expiry of the slots this process holds; the tokens back are the ones renewed.
UPDATE {schema}.concurrency_slots AS slot
   SET expires_at = now() + %(lease_ms)s * interval '1 millisecond'
  FROM unnest(%(keys)s::text[], %(tokens)s::bigint[]) AS held (key, token)
 WHERE slot.key = held.key AND slot.token = held.token
RETURNING slot.token
