-- Take a token of one key, or reserve the next one: one statement, the row lock orders workers.
-- The step between tokens is interval_ms, divided by slow_factor while the key is slowed.  The
-- job's slot is the earliest time it conforms: now, but not before paused_until nor before the
-- bucket has room (tat less the burst tolerance).  A slot now is a grant; a later slot is a
-- reservation the job is postponed to, so each waiting job comes back at its own time.
INSERT INTO {schema}.rate_limit_buckets AS b
    (key, limiter, interval_ms, burst, tat, last_granted, last_slot, granted, updated_at)
VALUES (
    %(key)s, %(limiter)s, %(interval_ms)s, %(burst)s,
    statement_timestamp() + make_interval(secs => %(interval_ms)s / 1000.0),
    true, statement_timestamp(), 1, statement_timestamp()
)
ON CONFLICT (key) DO UPDATE SET
    (limiter, interval_ms, burst, last_granted, last_slot, granted, postponed, tat, updated_at) = (
        SELECT excluded.limiter, excluded.interval_ms, excluded.burst,
               s.at <= s.now, s.at,
               b.granted + (s.at <= s.now)::int, b.postponed + (s.at > s.now)::int,
               greatest(b.tat, s.at) + s.step, s.now
        FROM (
            SELECT n.now, t.step,
                   greatest(n.now, coalesce(b.paused_until, '-infinity'), b.tat - t.step * (excluded.burst - 1)) AS at
            FROM (SELECT statement_timestamp() AS now) AS n,
                 LATERAL (
                     SELECT make_interval(secs => excluded.interval_ms / 1000.0
                         / CASE WHEN b.slowed_until > n.now THEN b.slow_factor ELSE 1 END) AS step
                 ) AS t
        ) AS s
    )
RETURNING b.last_granted AS granted,
          ceil(extract(epoch FROM b.last_slot - statement_timestamp()) * 1000)::bigint AS wait_ms,
          (extract(epoch FROM b.last_slot) * 1000)::bigint AS slot_ms,
          b.paused_until > statement_timestamp() AS paused
