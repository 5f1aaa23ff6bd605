-- How long the loop may sleep: until the earliest next fire time, as seen by the database clock
-- (or by the loop's own clock when it was given one: simulations and tests).
SELECT GREATEST(
           0,
           EXTRACT(EPOCH FROM (min(next_fire_at) - COALESCE(%(now)s::timestamptz, clock_timestamp()))) * 1000
       )::bigint AS due_in_ms,
       COALESCE(bool_or(buffered_fire_at IS NOT NULL), false) AS buffered
FROM {schema}.schedules
WHERE enabled AND NOT paused
