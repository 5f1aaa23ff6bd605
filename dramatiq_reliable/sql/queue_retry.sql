-- A retry of the message a worker holds, as one statement: the row takes the new body and
-- waits for its eta, and is no longer held, so the retry and the ack cannot come apart.
UPDATE {schema}.queue
SET body = %(body)s, priority = %(priority)s, lease = NULL,
    available_at = coalesce(to_timestamp(%(eta_ms)s::double precision / 1000), now())
WHERE id = %(id)s AND lease = %(lease)s
