-- Failure records whose retry is pending: not dead, not done (no processed key for the message).
SELECT a.message_id, a.queue_name, a.actor_name, a.attempts, a.max_retries, a.error_type, a.error_message,
       a.failed_at AS since, a.next_due_at
FROM {schema}.job_attempts a
WHERE a.outcome = 'retry'
  AND (%(actor)s::text IS NULL OR a.actor_name = %(actor)s)
  AND (%(queue)s::text IS NULL OR a.queue_name = %(queue)s)
  AND NOT EXISTS (SELECT 1 FROM {schema}.dead_letters d WHERE d.message_id = a.message_id AND d.state = 'dead')
  AND NOT EXISTS (SELECT 1 FROM {schema}.processed_jobs p
                  WHERE p.actor_name = a.actor_name AND p.job_key = a.message_id)
ORDER BY a.failed_at DESC
LIMIT %(limit)s
