-- The keys limited now: paused by the provider, slowed after a pause, or with jobs waiting on
-- reserved tokens.  waiting counts the reservations still ahead: the tokens between now and
-- tat less the burst the bucket holds anyway, or during a pause every token after its end.
SELECT key, limiter, interval_ms, burst, granted, postponed, paused_status, slow_factor,
       (extract(epoch FROM paused_until) * 1000)::bigint AS paused_until_ms,
       (extract(epoch FROM slowed_until) * 1000)::bigint AS slowed_until_ms,
       (extract(epoch FROM busy_until) * 1000)::bigint AS busy_until_ms,
       waiting
FROM (
    SELECT *,
           greatest(0, ceil(extract(epoch FROM tat - greatest(now(), coalesce(paused_until, '-infinity')))
               * 1000 / (interval_ms / CASE WHEN slowed_until > now() THEN slow_factor ELSE 1 END))
               - CASE WHEN paused_until > now() THEN 0 ELSE burst END)::bigint AS waiting,
           greatest(coalesce(paused_until, '-infinity'), tat - make_interval(secs => interval_ms / 1000.0
               / CASE WHEN slowed_until > now() THEN slow_factor ELSE 1 END * burst)) AS busy_until
    FROM {schema}.rate_limit_buckets
) AS keys
WHERE paused_until > now() OR slowed_until > now() OR waiting > 0
ORDER BY paused_until DESC NULLS LAST, waiting DESC, key
LIMIT %(limit)s
