-- Pause a key for every worker until the provider's Retry-After, and slow it after that.
-- A later pause never shortens an earlier one; the bucket row is created if no take made it yet.
INSERT INTO {schema}.rate_limit_buckets AS b
    (key, limiter, interval_ms, burst, tat, last_granted, last_slot,
     paused_until, paused_status, paused_by, slowed_until, slow_factor, updated_at)
VALUES (
    %(key)s, %(limiter)s, %(interval_ms)s, %(burst)s, statement_timestamp(), true, statement_timestamp(),
    statement_timestamp() + make_interval(secs => %(pause_ms)s / 1000.0), %(status)s, %(message_id)s,
    statement_timestamp() + make_interval(secs => (%(pause_ms)s + %(slow_ms)s) / 1000.0), %(slow_factor)s,
    statement_timestamp()
)
ON CONFLICT (key) DO UPDATE SET
    paused_until = greatest(coalesce(b.paused_until, '-infinity'), excluded.paused_until),
    paused_status = excluded.paused_status,
    paused_by = excluded.paused_by,
    slowed_until = greatest(coalesce(b.slowed_until, '-infinity'), excluded.slowed_until),
    slow_factor = least(coalesce(b.slow_factor, 1), excluded.slow_factor),
    updated_at = statement_timestamp()
RETURNING b.paused_until AS paused_until
