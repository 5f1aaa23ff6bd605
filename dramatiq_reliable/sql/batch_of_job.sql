-- The copies of a job's message Postgres still holds (a waiting or retained outbox row, a queue
-- row, its dead letter), each read on a message_id index; the caller reads their batch_id option
-- (batch_children has no index on message_id alone).  Bodies are parsed by the caller: a broker
-- with another encoder than JSON stores bytes that must not fail the query.
SELECT o.body, NULL::jsonb AS message FROM {schema}.outbox AS o WHERE o.message_id = %(message_id)s
UNION ALL
SELECT q.body, NULL::jsonb FROM {schema}.queue AS q WHERE q.message_id = %(message_id)s
UNION ALL
SELECT NULL::bytea, d.message FROM {schema}.dead_letters AS d WHERE d.message_id = %(message_id)s AND d.state = 'dead'
