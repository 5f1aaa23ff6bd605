SELECT message_id, queue_name, actor_name, error_type, error_message, culprit, attempts, reason,
       last_failed_at, message -> 'options' -> 'trace_context' ->> 'traceparent' AS traceparent
FROM {schema}.dead_letters
WHERE message_id = %(message_id)s AND state = 'dead'
