SELECT message_id, queue_name, actor_name, attempts, max_retries, outcome, reason, error_type,
       error_message, error_where, failed_at, next_due_at, trace_id
FROM {schema}.job_attempts
WHERE message_id = %(message_id)s
