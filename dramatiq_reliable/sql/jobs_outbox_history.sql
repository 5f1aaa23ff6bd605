-- jobs_outbox, for a schema with the partitioned history of published rows (migration 16):
-- the newest row of the message in either table.
SELECT message_id, queue_name, actor_name, created_at, available_at, published_at, attempts, last_error,
       available_at > now() AS later
FROM (
    SELECT id, message_id, queue_name, actor_name, created_at, available_at, published_at, attempts, last_error
    FROM {schema}.outbox
    WHERE message_id = %(message_id)s
    UNION ALL
    SELECT id, message_id, queue_name, actor_name, created_at, available_at, published_at, attempts, last_error
    FROM {schema}.outbox_published
    WHERE message_id = %(message_id)s
) AS rows
ORDER BY id DESC
LIMIT 1
