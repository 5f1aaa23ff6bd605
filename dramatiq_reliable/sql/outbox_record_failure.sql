-- A row that failed on its own backs off exponentially (capped) so it never blocks the others.
-- clock_timestamp(), not now(): the transaction began before the publish, which may have taken
-- the whole confirm timeout; the backoff counts from the failure.
UPDATE {schema}.outbox AS o
SET attempts = o.attempts + 1,
    last_error = f.error,
    available_at = clock_timestamp() + make_interval(secs => least(%(max_s)s, %(base_s)s * power(2, least(o.attempts, 30))))
FROM unnest(%(ids)s::bigint[], %(errors)s::text[]) AS f(id, error)
WHERE o.id = f.id
RETURNING o.id, o.attempts
