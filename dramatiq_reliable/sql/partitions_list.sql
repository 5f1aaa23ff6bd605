-- The partitions of a partitioned table with their bounds, oldest first.  A bound's text is a
-- quoted timestamptz with its offset, so it reads back the same whatever the session's TimeZone.
-- detach_pending: a DETACH ... CONCURRENTLY that was interrupted, to be finalised.
SELECT c.relname AS name,
       (regexp_match(pg_get_expr(c.relpartbound, c.oid), 'FROM \(''([^'']+)''\)'))[1]::timestamptz AS lower,
       (regexp_match(pg_get_expr(c.relpartbound, c.oid), 'TO \(''([^'']+)''\)'))[1]::timestamptz AS upper,
       i.inhdetachpending AS detach_pending
FROM pg_inherits AS i
JOIN pg_class AS c ON c.oid = i.inhrelid
WHERE i.inhparent = to_regclass(%(parent)s)
ORDER BY 2
