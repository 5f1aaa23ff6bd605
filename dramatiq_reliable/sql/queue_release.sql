-- Give held rows back at once (a worker shutting down): visible again, no lease.
UPDATE {schema}.queue AS q
SET available_at = now(), lease = NULL
FROM unnest(%(ids)s::bigint[], %(leases)s::bigint[]) AS r(id, lease)
WHERE q.id = r.id AND q.lease = r.lease
