-- The stored timing of the declared schedules, read before a sync changes them: a schedule
-- redefined with the same timing fires its retracted ticks written ahead again.
SELECT name, definition_hash, enabled
FROM {schema}.schedules
WHERE name = ANY(%(names)s::text[])
