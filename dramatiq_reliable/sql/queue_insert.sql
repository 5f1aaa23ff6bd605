-- One message into a Postgres queue, in the caller's transaction; a delayed one waits for its eta.
INSERT INTO {schema}.queue (queue_name, message_id, actor_name, body, priority, available_at)
VALUES (%(queue_name)s, %(message_id)s, %(actor_name)s, %(body)s, %(priority)s,
        coalesce(to_timestamp(%(eta_ms)s::double precision / 1000), now()))
