-- Bounded batches keep each delete short; the caller loops until a batch comes back short.
DELETE FROM {schema}.outbox
WHERE id IN (
    SELECT id FROM {schema}.outbox
    WHERE published_at IS NOT NULL AND published_at < now() - make_interval(secs => %(older_than_s)s)
    LIMIT %(batch)s
)
