-- Extend the leases a live consumer still holds; rows it lost are not touched.
UPDATE {schema}.queue AS q
SET available_at = now() + make_interval(secs => %(lease_s)s::double precision)
FROM unnest(%(ids)s::bigint[], %(leases)s::bigint[]) AS h(id, lease)
WHERE q.id = h.id AND q.lease = h.lease
