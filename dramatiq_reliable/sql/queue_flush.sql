-- Drop every message of the given queues (and their dead ".XQ" rows), as RabbitMQ's purge does.
DELETE FROM {schema}.queue WHERE queue_name = ANY(%(queue_names)s::text[])
