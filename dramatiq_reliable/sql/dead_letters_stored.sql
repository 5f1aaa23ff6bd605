-- How many of these .XQ messages (message id, and the dead letter each was replayed from, 0 if
-- never) already have a row for their death: the rest exist only in RabbitMQ.
SELECT count(*) AS stored
FROM unnest(%(message_ids)s::text[], %(after_ids)s::bigint[]) AS k(message_id, after_id)
WHERE EXISTS (
    SELECT 1 FROM {schema}.dead_letters AS d WHERE d.message_id = k.message_id AND d.id > k.after_id
)
