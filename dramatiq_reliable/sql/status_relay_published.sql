-- How long ago a relay last published: the newest published_at of the rows it keeps
-- (on_published="mark", the default, for retention_ms).  The partial index outbox_published_at
-- answers it from its last entry, so it is cheap enough for a metrics scrape.  NULL when no
-- published row is kept (on_published="delete", or nothing published within retention).
SELECT extract(epoch FROM now() - max(published_at))::double precision AS age_s
FROM {schema}.outbox
WHERE published_at IS NOT NULL
