-- A failed message: deleted when the DeadLetters middleware stored it (a 'dead' row with its
-- message_id), otherwise kept as "<queue>.XQ" until retention purges it, as RabbitMQ keeps its
-- dead-letter queue.  Either way it leaves the queue in one statement.
WITH target AS (
    SELECT q.id, EXISTS (
               SELECT 1 FROM {schema}.dead_letters AS d WHERE d.message_id = q.message_id AND d.state = 'dead'
           ) AS stored
    FROM {schema}.queue AS q
    WHERE q.id = %(id)s AND q.lease = %(lease)s
), deleted AS (
    DELETE FROM {schema}.queue AS q USING target AS t WHERE q.id = t.id AND t.stored RETURNING q.id
), kept AS (
    UPDATE {schema}.queue AS q
    SET queue_name = %(xq_name)s, available_at = 'infinity', lease = NULL, enqueued_at = now()
    FROM target AS t
    WHERE q.id = t.id AND NOT t.stored
    RETURNING q.id
)
SELECT (SELECT count(*) FROM deleted) AS deleted, (SELECT count(*) FROM kept) AS kept
