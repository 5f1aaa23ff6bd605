-- As schedule_fire.sql, for a PostgresBroker: the messages of the ticks that fire go straight
-- into the queue table (there is no relay), in the same statement that records the ticks.  A
-- tick written ahead (available_at, its fire time, later than now) is not claimed until due.
WITH planned AS (
    SELECT *
    FROM unnest(
        %(names)s::text[], %(fire_ats)s::timestamptz[], %(message_ids)s::text[], %(states)s::text[],
        %(reasons)s::text[], %(queue_names)s::text[], %(actor_names)s::text[], %(bodies)s::bytea[],
        %(priorities)s::smallint[], %(available_ats)s::timestamptz[]
    ) AS p(schedule_name, fire_at, message_id, state, reason, queue_name, actor_name, body, priority, available_at)
), recorded AS (
    INSERT INTO {schema}.schedule_ticks (schedule_name, fire_at, message_id, state, reason)
    SELECT schedule_name, fire_at, message_id, state, reason FROM planned
    ON CONFLICT (schedule_name, fire_at) DO NOTHING
    RETURNING schedule_name, fire_at
)
INSERT INTO {schema}.queue (queue_name, message_id, actor_name, body, priority, available_at)
SELECT p.queue_name, p.message_id, p.actor_name, p.body, p.priority, COALESCE(p.available_at, now())
FROM planned p
JOIN recorded r ON r.schedule_name = p.schedule_name AND r.fire_at = p.fire_at
WHERE p.state = 'enqueued'
