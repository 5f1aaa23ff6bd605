-- The outbox's own heartbeat: the newest publish (rows kept after publishing, in the outbox or
-- its partitioned history) and the oldest
-- row the relay should have published by now.  A due row that waits long means no relay runs
-- (or none reaches RabbitMQ); rows that failed on their own are left out (they back off).
SELECT greatest((SELECT max(published_at) FROM {schema}.outbox WHERE published_at IS NOT NULL),
                (SELECT max(published_at) FROM {schema}.outbox_published)) AS last_published_at,
       (SELECT count(*) FROM {schema}.outbox
        WHERE published_at IS NULL AND attempts = 0 AND available_at <= now()) AS due,
       (SELECT extract(epoch FROM now() - min(available_at))::double precision FROM {schema}.outbox
        WHERE published_at IS NULL AND attempts = 0 AND available_at <= now()) AS oldest_due_age_s
