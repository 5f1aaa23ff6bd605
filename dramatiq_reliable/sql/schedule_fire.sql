-- One statement records the pass's ticks and writes the messages of those that fire into the
-- outbox.  The ticks' primary key refuses a tick recorded before; its message is then not written.
-- A tick written ahead (available_at, its fire time, later than now) waits in the outbox until due.
WITH planned AS (
    SELECT *
    FROM unnest(
        %(names)s::text[], %(fire_ats)s::timestamptz[], %(message_ids)s::text[], %(states)s::text[],
        %(reasons)s::text[], %(queue_names)s::text[], %(actor_names)s::text[], %(bodies)s::bytea[],
        %(available_ats)s::timestamptz[]
    ) AS p(schedule_name, fire_at, message_id, state, reason, queue_name, actor_name, body, available_at)
), recorded AS (
    INSERT INTO {schema}.schedule_ticks (schedule_name, fire_at, message_id, state, reason)
    SELECT schedule_name, fire_at, message_id, state, reason FROM planned
    ON CONFLICT (schedule_name, fire_at) DO NOTHING
    RETURNING schedule_name, fire_at
)
INSERT INTO {schema}.outbox (message_id, queue_name, actor_name, body, available_at)
SELECT p.message_id, p.queue_name, p.actor_name, p.body, COALESCE(p.available_at, now())
FROM planned p
JOIN recorded r ON r.schedule_name = p.schedule_name AND r.fire_at = p.fire_at
WHERE p.state = 'enqueued'
