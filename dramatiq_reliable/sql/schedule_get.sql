-- One schedule, locked, for pause, resume and trigger.
SELECT name, actor_name, queue_name, cron, interval_ms, tz, args, kwargs, options, missed, misfire_grace_ms,
       backfill_window_ms, overlap, stale_after_ms, enabled, paused, clock_timestamp() AS now
FROM {schema}.schedules
WHERE name = %(name)s
FOR UPDATE
