-- Take back the ticks written ahead (reason 'ahead') of these schedules that are not due yet:
-- their outbox rows (not yet published: a relay claims a row only once its available_at, the
-- fire time, has passed) and their tick rows, so a paused, disabled or redefined schedule never
-- fires a tick written before the change.  Returns each schedule's earliest retracted fire time,
-- so a schedule whose timing did not change can be rewound to fire it again, as redefined.
WITH ahead AS (
    SELECT t.message_id
    FROM {schema}.schedule_ticks t
    WHERE t.schedule_name = ANY(%(names)s::text[])
      AND t.reason = 'ahead' AND t.state = 'enqueued' AND t.fire_at > clock_timestamp()
), gone AS (
    DELETE FROM {schema}.outbox o
    USING ahead a
    WHERE o.message_id = a.message_id AND o.published_at IS NULL AND o.available_at > clock_timestamp()
    RETURNING o.message_id
), dropped AS (
    DELETE FROM {schema}.schedule_ticks t
    USING gone g
    WHERE t.message_id = g.message_id AND t.reason = 'ahead'
    RETURNING t.schedule_name, t.fire_at
)
SELECT schedule_name, min(fire_at) AS first_fire_at
FROM dropped
GROUP BY schedule_name
