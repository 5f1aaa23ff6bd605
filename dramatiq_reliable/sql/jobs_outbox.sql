-- The newest row of the message (a retry adds a row with the same message_id).
SELECT message_id, queue_name, actor_name, created_at, available_at, published_at, attempts, last_error,
       available_at > now() AS later
FROM {schema}.outbox
WHERE message_id = %(message_id)s
ORDER BY id DESC
LIMIT 1
