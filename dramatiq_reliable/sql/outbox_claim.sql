-- SKIP LOCKED lets several relays run at once: each claims rows no other relay holds.
-- Due rows in due order (available_at: now() at insert, a delayed message's eta, a failed
-- row's next try), on the index outbox_due, so rows scheduled for later are never read.
-- Rows that failed max_attempts times are left for an operator (the poison path): they stay
-- counted as failing and are never claimed again until their attempts are reset.
SELECT id, message_id, queue_name, body, priority, octet_length(body) AS size
FROM {schema}.outbox
WHERE published_at IS NULL AND available_at <= now() AND attempts < %(max_attempts)s
ORDER BY available_at, id
LIMIT %(batch_size)s
FOR UPDATE SKIP LOCKED
