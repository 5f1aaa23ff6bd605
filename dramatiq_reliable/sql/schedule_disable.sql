-- Schedules no longer declared in code stop firing (their rows and ticks stay for the record).
UPDATE {schema}.schedules
SET enabled = false, buffered_fire_at = NULL, updated_at = now()
WHERE enabled AND NOT (name = ANY(%(names)s::text[]))
RETURNING name
