INSERT INTO {schema}.job_attempts AS a (
    message_id, queue_name, actor_name, attempts, max_retries, outcome, reason,
    error_type, error_message, error_where, failed_at, next_due_at, trace_id, expires_at
)
VALUES (
    %(message_id)s, %(queue_name)s, %(actor_name)s, %(attempts)s, %(max_retries)s, %(outcome)s, %(reason)s,
    %(error_type)s, %(error_message)s, %(error_where)s, now(),
    now() + make_interval(secs => %(delay_ms)s::double precision / 1000),
    %(trace_id)s, now() + make_interval(secs => %(retention_ms)s::double precision / 1000)
)
ON CONFLICT (message_id) DO UPDATE SET
    queue_name = EXCLUDED.queue_name,
    actor_name = EXCLUDED.actor_name,
    -- a late write of an older attempt never lowers the count
    attempts = greatest(a.attempts, EXCLUDED.attempts),
    max_retries = EXCLUDED.max_retries,
    outcome = EXCLUDED.outcome,
    reason = EXCLUDED.reason,
    error_type = EXCLUDED.error_type,
    error_message = EXCLUDED.error_message,
    error_where = EXCLUDED.error_where,
    failed_at = EXCLUDED.failed_at,
    next_due_at = EXCLUDED.next_due_at,
    trace_id = coalesce(EXCLUDED.trace_id, a.trace_id),
    expires_at = EXCLUDED.expires_at
