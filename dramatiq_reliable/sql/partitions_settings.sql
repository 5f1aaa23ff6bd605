SELECT table_name, interval_ms, ahead, retention_ms, maintained_at
FROM {schema}.partitioned_tables
WHERE table_name = %(table_name)s
