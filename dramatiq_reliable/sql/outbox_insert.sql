-- A delayed message's row waits until its eta: available_at is when the relay may claim it
-- (its due time), so nothing waits unacked in a worker for its delay.
INSERT INTO {schema}.outbox (message_id, queue_name, actor_name, body, priority, eta, available_at)
VALUES (
    %(message_id)s, %(queue_name)s, %(actor_name)s, %(body)s, %(priority)s,
    to_timestamp(%(eta_ms)s::double precision / 1000),
    coalesce(to_timestamp(%(eta_ms)s::double precision / 1000), now())
)
