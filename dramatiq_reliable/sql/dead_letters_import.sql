-- Store one message moved from RabbitMQ's ".XQ" queue, unless its death already has a row: a
-- row of the same message_id newer than the dead letter it was replayed from (after_id, 0 for a
-- message never replayed).  Re-running an import therefore adds nothing twice, and a message whose
-- capture did succeed is only acked off ".XQ".  Returns no row when nothing was inserted.
WITH stored AS (
    INSERT INTO {schema}.dead_letters AS d (
        message_id, queue_name, actor_name, message, error_type, error_message, traceback,
        attempts, reason, http_status, retry_decision, fingerprint, culprit,
        sent_at, first_failed_at, last_failed_at, worker_host, worker_pid
    )
    -- A SELECT, not VALUES, so that WHERE NOT EXISTS can skip it: every parameter is cast,
    -- as a select list gives NULLs no column type.
    SELECT
        %(message_id)s::text, %(queue_name)s::text, %(actor_name)s::text, %(message)s::jsonb,
        %(error_type)s::text, %(error_message)s::text, %(traceback)s::text, %(attempts)s::integer,
        %(reason)s::text, %(http_status)s::smallint, %(retry_decision)s::jsonb, %(fingerprint)s::text,
        %(culprit)s::text,
        to_timestamp(%(sent_ms)s::double precision / 1000),
        least(now(), coalesce(to_timestamp(%(first_failed_ms)s::double precision / 1000), now())),
        now(), %(worker_host)s::text, %(worker_pid)s::integer
    WHERE NOT EXISTS (
        SELECT 1 FROM {schema}.dead_letters
        WHERE message_id = %(message_id)s AND id > %(after_id)s::bigint
    )
    ON CONFLICT (message_id) WHERE state = 'dead' DO NOTHING
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
