-- How long the loop may sleep: until the earliest next fire time, as seen by the database clock
-- (or by the loop's own clock when it was given one: simulations and tests).  An
-- overlap='allow' schedule is claimed lead_ms early (its tick is written ahead).
SELECT GREATEST(
           0,
           EXTRACT(EPOCH FROM (min(
               CASE WHEN overlap = 'allow'
                    THEN next_fire_at - make_interval(secs => %(lead_ms)s / 1000.0)
                    ELSE next_fire_at END
           ) - COALESCE(%(now)s::timestamptz, clock_timestamp()))) * 1000
       )::bigint AS due_in_ms,
       COALESCE(bool_or(buffered_fire_at IS NOT NULL), false) AS buffered
FROM {schema}.schedules
WHERE enabled AND NOT paused
