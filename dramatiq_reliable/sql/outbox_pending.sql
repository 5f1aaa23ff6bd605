-- Committed rows of the given queues (a queue and its ".DQ") that no relay has published yet:
-- what OutboxBroker.join() waits for besides RabbitMQ's own queue.  Rows the relay gave up on
-- count too (their messages were never delivered).  Reads the partial index of unpublished
-- rows, so it costs the backlog, not the table.
SELECT count(*) AS pending
FROM {schema}.outbox
WHERE published_at IS NULL AND queue_name = ANY(%(queue_names)s::text[])
