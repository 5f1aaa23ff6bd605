INSERT INTO {schema}.outbox (message_id, queue_name, actor_name, body, priority, eta)
VALUES (
    %(message_id)s, %(queue_name)s, %(actor_name)s, %(body)s, %(priority)s,
    to_timestamp(%(eta_ms)s::double precision / 1000)
)
