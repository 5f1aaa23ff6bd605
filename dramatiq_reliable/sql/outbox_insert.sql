INSERT INTO {schema}.outbox (message_id, queue_name, actor_name, body, priority, eta)
VALUES (%s, %s, %s, %s, %s, to_timestamp(%s::double precision / 1000))
