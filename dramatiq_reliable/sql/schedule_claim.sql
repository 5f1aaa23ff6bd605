-- SKIP LOCKED lets any number of scheduler loops claim due schedules without a leader:
-- a row one loop holds is invisible to the others until its tick's transaction commits.
-- "ahead" is now plus the scheduler's lead_ms: an overlap='allow' schedule due by then is
-- claimed early and its tick written ahead with the fire time as the outbox row's due time (the
-- other policies need the run state at the fire time, so they are claimed only once due).
SELECT s.name, s.actor_name, s.queue_name, s.cron, s.interval_ms, s.tz, s.args, s.kwargs, s.options,
       s.missed, s.misfire_grace_ms, s.backfill_window_ms, s.overlap, s.stale_after_ms,
       s.next_fire_at, s.buffered_fire_at,
       EXISTS (
           SELECT 1 FROM {schema}.schedule_ticks t
           WHERE t.schedule_name = s.name
             AND t.state IN ('enqueued', 'running', 'retrying')
             AND t.updated_at > %(now)s - make_interval(secs => s.stale_after_ms / 1000.0)
       ) AS busy
FROM {schema}.schedules s
WHERE s.enabled AND NOT s.paused
  AND (s.next_fire_at <= %(now)s
       OR (s.overlap = 'allow' AND s.next_fire_at <= %(ahead)s)
       OR s.buffered_fire_at IS NOT NULL)
ORDER BY s.next_fire_at
LIMIT %(batch_size)s
FOR UPDATE OF s SKIP LOCKED
