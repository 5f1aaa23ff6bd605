-- status_relay_published, for a schema whose published rows may be in the partitioned history
-- (migration 16): the newest of both tables, each answered from its index's last entry.
SELECT extract(epoch FROM now() - greatest(
           (SELECT max(published_at) FROM {schema}.outbox WHERE published_at IS NOT NULL),
           (SELECT max(published_at) FROM {schema}.outbox_published)
       ))::double precision AS age_s
