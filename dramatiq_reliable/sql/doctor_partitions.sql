-- The partitioned history of published outbox rows (migration 16): its settings, when it was
-- last maintained, and the end of its newest partition (publishes past it stay in the outbox).
SELECT s.interval_ms, s.maintained_at, p.covered_until,
       extract(epoch FROM p.covered_until - now())::double precision AS ahead_s
FROM {schema}.partitioned_tables AS s
CROSS JOIN LATERAL (
    SELECT max((regexp_match(pg_get_expr(c.relpartbound, c.oid), 'TO \(''([^'']+)''\)'))[1]::timestamptz)
           AS covered_until
    FROM pg_inherits AS i
    JOIN pg_class AS c ON c.oid = i.inhrelid
    WHERE i.inhparent = to_regclass(%(parent)s) AND NOT i.inhdetachpending
) AS p
WHERE s.table_name = 'outbox_published'
