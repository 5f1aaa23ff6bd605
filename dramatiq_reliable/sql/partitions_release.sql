UPDATE {schema}.partitioned_tables
SET maintenance_until = NULL, maintained_at = now(), covered_until = %(covered_until)s
WHERE table_name = %(table_name)s
