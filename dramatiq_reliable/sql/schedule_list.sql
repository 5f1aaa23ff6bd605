-- Every schedule with its last tick (and that tick's run state), for 'schedules list'.
SELECT s.name, s.actor_name, s.queue_name, s.cron, s.interval_ms, s.tz, s.missed, s.overlap,
       s.enabled, s.paused, s.next_fire_at, s.buffered_fire_at,
       t.fire_at AS last_fire_at, t.state AS last_state, t.reason AS last_reason, t.message_id AS last_message_id,
       t.finished_at AS last_finished_at
FROM {schema}.schedules s
LEFT JOIN LATERAL (
    SELECT fire_at, state, reason, message_id, finished_at
    FROM {schema}.schedule_ticks
    WHERE schedule_name = s.name
    ORDER BY fire_at DESC
    LIMIT 1
) t ON true
WHERE %(name)s::text IS NULL OR s.name = %(name)s
ORDER BY s.name
