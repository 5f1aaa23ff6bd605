-- Store one dead message and announce it on the "<schema>.dead_letters" channel (delivered on
-- commit).  pg_notify here, not in a trigger, so bulk loads and replays send no notifications.
-- A second capture of a message that is still dead (RabbitMQ redelivered it after a worker
-- crashed between this insert and the nack) refreshes the row instead of adding one.
WITH stored AS (
    INSERT INTO {schema}.dead_letters AS d (
        message_id, queue_name, actor_name, message, error_type, error_message, traceback,
        attempts, reason, http_status, retry_decision, fingerprint, culprit,
        sent_at, first_failed_at, last_failed_at, worker_host, worker_pid
    )
    VALUES (
        %(message_id)s, %(queue_name)s, %(actor_name)s, %(message)s::jsonb, %(error_type)s,
        %(error_message)s, %(traceback)s, %(attempts)s, %(reason)s, %(http_status)s,
        %(retry_decision)s::jsonb, %(fingerprint)s, %(culprit)s,
        to_timestamp(%(sent_ms)s::double precision / 1000),
        least(now(), coalesce(to_timestamp(%(first_failed_ms)s::double precision / 1000), now())),
        now(), %(worker_host)s, %(worker_pid)s
    )
    ON CONFLICT (message_id) WHERE state = 'dead' DO UPDATE SET
        message = EXCLUDED.message,
        error_type = EXCLUDED.error_type,
        error_message = EXCLUDED.error_message,
        traceback = EXCLUDED.traceback,
        attempts = greatest(d.attempts, EXCLUDED.attempts),
        reason = EXCLUDED.reason,
        http_status = EXCLUDED.http_status,
        retry_decision = EXCLUDED.retry_decision,
        fingerprint = EXCLUDED.fingerprint,
        culprit = EXCLUDED.culprit,
        first_failed_at = least(d.first_failed_at, EXCLUDED.first_failed_at),
        last_failed_at = EXCLUDED.last_failed_at,
        worker_host = EXCLUDED.worker_host,
        worker_pid = EXCLUDED.worker_pid,
        captures = d.captures + 1
    RETURNING d.id, d.message_id, d.queue_name, d.actor_name, d.error_type, d.fingerprint,
              d.captures, d.sent_at, d.first_failed_at, d.last_failed_at
)
SELECT id, captures, sent_at, first_failed_at, last_failed_at,
       pg_notify(
           %(channel)s,
           json_build_object(
               'id', id, 'message_id', message_id, 'queue_name', queue_name, 'actor_name', actor_name,
               'error_type', error_type, 'fingerprint', fingerprint
           )::text
       )::text AS notified
FROM stored
