-- The batch a job is a child of, by the children's message_id index (migration 21): found
-- whether or not Postgres still holds a copy of its message.
SELECT c.batch_id, c.state FROM {schema}.batch_children AS c
 WHERE c.message_id = %(message_id)s
 ORDER BY c.batch_id
 LIMIT 1
