-- Extend the leases this process still holds; leases it lost (reaped, taken over) are not touched.
UPDATE {schema}.job_leases AS l
SET expires_at = now() + make_interval(secs => %(lease_s)s::double precision)
FROM unnest(%(message_ids)s::text[], %(tokens)s::bigint[]) AS h(message_id, token)
WHERE l.message_id = h.message_id AND l.token = h.token
RETURNING l.message_id
