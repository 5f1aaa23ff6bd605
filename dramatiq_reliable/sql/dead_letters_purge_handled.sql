-- Bounded batches keep each delete short; the caller loops until a batch comes back short.
DELETE FROM {schema}.dead_letters
WHERE id IN (
    SELECT id FROM {schema}.dead_letters
    WHERE state <> 'dead' AND handled_at < now() - make_interval(secs => %(older_than_s)s::double precision)
    LIMIT %(batch)s
)
