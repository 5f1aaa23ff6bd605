-- Upsert one schedule declared in code.  The next fire time is kept unless the timing changed or
-- the schedule comes back from being disabled; the operator's pause survives every sync.
INSERT INTO {schema}.schedules AS s (
    name, actor_name, queue_name, cron, interval_ms, tz, args, kwargs, options, missed, misfire_grace_ms,
    backfill_window_ms, overlap, stale_after_ms, definition_hash, next_fire_at
) VALUES (
    %(name)s, %(actor_name)s, %(queue_name)s, %(cron)s, %(interval_ms)s, %(tz)s, %(args)s::jsonb,
    %(kwargs)s::jsonb, %(options)s::jsonb, %(missed)s, %(misfire_grace_ms)s, %(backfill_window_ms)s,
    %(overlap)s, %(stale_after_ms)s, %(definition_hash)s, %(next_fire_at)s
)
ON CONFLICT (name) DO UPDATE SET
    actor_name = EXCLUDED.actor_name,
    queue_name = EXCLUDED.queue_name,
    cron = EXCLUDED.cron,
    interval_ms = EXCLUDED.interval_ms,
    tz = EXCLUDED.tz,
    args = EXCLUDED.args,
    kwargs = EXCLUDED.kwargs,
    options = EXCLUDED.options,
    missed = EXCLUDED.missed,
    misfire_grace_ms = EXCLUDED.misfire_grace_ms,
    backfill_window_ms = EXCLUDED.backfill_window_ms,
    overlap = EXCLUDED.overlap,
    stale_after_ms = EXCLUDED.stale_after_ms,
    next_fire_at = CASE
        WHEN s.definition_hash <> EXCLUDED.definition_hash OR NOT s.enabled OR s.next_fire_at IS NULL
        THEN EXCLUDED.next_fire_at ELSE s.next_fire_at END,
    buffered_fire_at = CASE WHEN s.enabled THEN s.buffered_fire_at END,
    definition_hash = EXCLUDED.definition_hash,
    enabled = true,
    updated_at = now()
WHERE (s.actor_name, s.queue_name, s.cron, s.interval_ms, s.tz, s.args, s.kwargs, s.options, s.missed,
       s.misfire_grace_ms, s.backfill_window_ms, s.overlap, s.stale_after_ms, s.definition_hash, s.enabled)
      IS DISTINCT FROM
      (EXCLUDED.actor_name, EXCLUDED.queue_name, EXCLUDED.cron, EXCLUDED.interval_ms, EXCLUDED.tz, EXCLUDED.args,
       EXCLUDED.kwargs, EXCLUDED.options, EXCLUDED.missed, EXCLUDED.misfire_grace_ms, EXCLUDED.backfill_window_ms,
       EXCLUDED.overlap, EXCLUDED.stale_after_ms, EXCLUDED.definition_hash, true)
RETURNING name
