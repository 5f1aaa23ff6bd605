SELECT id, message_id, queue_name, actor_name, error_type, error_message, attempts, reason,
       http_status, fingerprint, culprit, state, sent_at, first_failed_at, last_failed_at,
       worker_host, worker_pid, captures, handled_at, handled_by, note, replayed_to,
       message, traceback, retry_decision
FROM {schema}.dead_letters
WHERE id = %(id)s
