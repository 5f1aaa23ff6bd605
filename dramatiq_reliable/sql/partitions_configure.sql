-- Enabling again changes the retention and how far ahead partitions are made, never the width
-- of partitions already made (the caller refuses a different interval).
INSERT INTO {schema}.partitioned_tables AS p (table_name, interval_ms, ahead, retention_ms)
VALUES (%(table_name)s, %(interval_ms)s, %(ahead)s, %(retention_ms)s)
ON CONFLICT (table_name) DO UPDATE SET ahead = EXCLUDED.ahead, retention_ms = EXCLUDED.retention_ms
RETURNING p.interval_ms
