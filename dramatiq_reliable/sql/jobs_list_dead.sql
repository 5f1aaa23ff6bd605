SELECT d.message_id, d.queue_name, d.actor_name, d.attempts, NULL::integer AS max_retries, d.error_type,
       d.error_message, d.last_failed_at AS since, NULL::timestamptz AS next_due_at
FROM {schema}.dead_letters d
WHERE d.state = 'dead'
  AND (%(actor)s::text IS NULL OR d.actor_name = %(actor)s)
  AND (%(queue)s::text IS NULL OR d.queue_name = %(queue)s)
ORDER BY d.last_failed_at DESC, d.id DESC
LIMIT %(limit)s
