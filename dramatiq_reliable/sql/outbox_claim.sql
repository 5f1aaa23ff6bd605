-- SKIP LOCKED lets several relays run at once: each claims rows no other relay holds.
SELECT id, message_id, queue_name, body, priority
FROM {schema}.outbox
WHERE published_at IS NULL AND available_at <= now()
ORDER BY id
LIMIT %s
FOR UPDATE SKIP LOCKED
