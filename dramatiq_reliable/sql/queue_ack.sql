-- Acked rows are deleted (autovacuum reclaims them); a row whose lease was lost (claimed again
-- since) is left to its new holder.
DELETE FROM {schema}.queue AS q
USING unnest(%(ids)s::bigint[], %(leases)s::bigint[]) AS a(id, lease)
WHERE q.id = a.id AND q.lease = a.lease
