-- OutboxBroker.flush(): the unpublished rows of the given queues go, as RabbitMQ's purge drops
-- their messages.  Published rows stay for audit until retention purges them.  A row a relay
-- holds is waited for; published by then, it is kept here and purged from RabbitMQ after this.
DELETE FROM {schema}.outbox
WHERE published_at IS NULL AND queue_name = ANY(%(queue_names)s::text[])
