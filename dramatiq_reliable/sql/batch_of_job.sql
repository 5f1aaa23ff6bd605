-- The batch a job belongs to, found through its message's batch_id option where a copy of the
-- message is kept (a waiting or retained outbox row, a queue row, a dead letter), every read on a
-- message_id index; batch_children has no index on message_id alone.
SELECT c.batch_id, c.state
  FROM (SELECT convert_from(o.body, 'UTF8')::jsonb -> 'options' ->> 'batch_id' AS batch_id
          FROM {schema}.outbox AS o
         WHERE o.message_id = %(message_id)s
        UNION ALL
        SELECT convert_from(q.body, 'UTF8')::jsonb -> 'options' ->> 'batch_id'
          FROM {schema}.queue AS q
         WHERE q.message_id = %(message_id)s
        UNION ALL
        SELECT d.message -> 'options' ->> 'batch_id'
          FROM {schema}.dead_letters AS d
         WHERE d.message_id = %(message_id)s AND d.state = 'dead') AS found
  JOIN {schema}.batch_children AS c ON c.batch_id = found.batch_id AND c.message_id = %(message_id)s
 LIMIT 1
