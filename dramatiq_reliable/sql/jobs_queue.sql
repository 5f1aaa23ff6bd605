SELECT message_id, queue_name, actor_name, enqueued_at, available_at, lease, deliveries,
       available_at > now() AS later
FROM {schema}.queue
WHERE message_id = %(message_id)s
ORDER BY id DESC
LIMIT 1
