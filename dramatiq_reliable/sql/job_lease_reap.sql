-- Leases that ran out (their worker died) become outbox rows again, in one statement: the
-- message is never in both places and never in neither.  SKIP LOCKED lets several relays reap.
WITH expired AS (
    DELETE FROM {schema}.job_leases
    WHERE message_id IN (
        SELECT message_id FROM {schema}.job_leases
        WHERE expires_at < now()
        ORDER BY expires_at
        LIMIT %(limit)s
        FOR UPDATE SKIP LOCKED
    )
    RETURNING message_id, queue_name, actor_name, body, priority, owner, takes
), requeued AS (
    INSERT INTO {schema}.outbox (message_id, queue_name, actor_name, body, priority)
    SELECT message_id, queue_name, actor_name, body, priority FROM expired
)
SELECT message_id, actor_name, owner, takes FROM expired
