-- Retention: dead ".XQ" rows older than the limit go, in bounded batches (oldest first).
DELETE FROM {schema}.queue
WHERE id = ANY(ARRAY(
    SELECT id FROM {schema}.queue
    WHERE queue_name LIKE '%%.XQ' AND enqueued_at < now() - make_interval(secs => %(older_than_s)s::double precision)
    ORDER BY id
    LIMIT %(batch_size)s
))
