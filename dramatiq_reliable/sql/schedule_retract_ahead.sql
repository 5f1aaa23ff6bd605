-- Take back the ticks written ahead (reason 'ahead') of these schedules that are not due yet:
-- their messages (an outbox row not yet published, or a PostgresBroker queue row not yet
-- claimed: a relay or a consumer takes a row only once its available_at, the fire time, has
-- passed) and their tick rows, so a paused, disabled or redefined schedule never fires a tick
-- written before the change.  Returns each schedule's earliest retracted fire time, so a
-- schedule whose timing did not change can be rewound to fire it again, as redefined.
WITH ahead AS (
    SELECT t.message_id
    FROM {schema}.schedule_ticks t
    WHERE t.schedule_name = ANY(%(names)s::text[])
      AND t.reason = 'ahead' AND t.state = 'enqueued' AND t.fire_at > clock_timestamp()
), gone_outbox AS (
    DELETE FROM {schema}.outbox o
    USING ahead a
    WHERE o.message_id = a.message_id AND o.published_at IS NULL AND o.available_at > clock_timestamp()
    RETURNING o.message_id
), gone_queue AS (
    DELETE FROM {schema}.queue q
    USING ahead a
    WHERE q.message_id = a.message_id AND q.lease IS NULL AND q.available_at > clock_timestamp()
    RETURNING q.message_id
), dropped AS (
    DELETE FROM {schema}.schedule_ticks t
    WHERE t.reason = 'ahead'
      AND t.message_id IN (SELECT message_id FROM gone_outbox UNION ALL SELECT message_id FROM gone_queue)
    RETURNING t.schedule_name, t.fire_at
)
SELECT schedule_name, min(fire_at) AS first_fire_at
FROM dropped
GROUP BY schedule_name
