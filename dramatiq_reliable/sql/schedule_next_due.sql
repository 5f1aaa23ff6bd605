-- How long the loop may sleep: until the earliest next fire time, as seen by the database clock.
SELECT GREATEST(0, EXTRACT(EPOCH FROM (min(next_fire_at) - clock_timestamp())) * 1000)::bigint,
       bool_or(buffered_fire_at IS NOT NULL)
FROM {schema}.schedules
WHERE enabled AND NOT paused
