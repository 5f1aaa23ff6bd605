UPDATE {schema}.partitioned_tables SET maintenance_until = NULL, maintained_at = now()
WHERE table_name = %(table_name)s
