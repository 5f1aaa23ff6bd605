-- One maintainer at a time (a lease row, safe behind a pooler); a lease whose holder died lapses.
UPDATE {schema}.partitioned_tables
SET maintenance_until = now() + make_interval(secs => %(lease_s)s::double precision)
WHERE table_name = %(table_name)s AND (maintenance_until IS NULL OR maintenance_until < now())
RETURNING interval_ms, ahead, retention_ms, now() AS now
