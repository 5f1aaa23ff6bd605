-- The rows outbox_purge would delete now: what 'outbox purge' counts before it asks.
-- Reads the partial index outbox_published_at.
SELECT count(*) AS published
FROM {schema}.outbox
WHERE published_at IS NOT NULL AND published_at < now() - make_interval(secs => %(older_than_s)s)
