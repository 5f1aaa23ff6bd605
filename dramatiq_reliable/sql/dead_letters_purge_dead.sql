-- Dead rows past retention: too old to replay, and still in RabbitMQ's ".XQ" only until its TTL.
DELETE FROM {schema}.dead_letters
WHERE id IN (
    SELECT id FROM {schema}.dead_letters
    WHERE state = 'dead' AND last_failed_at < now() - make_interval(secs => %(older_than_s)s::double precision)
    LIMIT %(batch)s
)
