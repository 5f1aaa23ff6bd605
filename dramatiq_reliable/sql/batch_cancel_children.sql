-- After the cancel: the children not finished are cancelled (their jobs are cancelled by message
-- id in the same transaction).  SKIP LOCKED: a child locked now is finishing in its job's
-- transaction and will wait for the batch's row, held here; waiting for it would deadlock, and
-- once it commits it finds the batch cancelled and fires nothing.
UPDATE {schema}.batch_children AS c SET state = 'cancelled', finished_at = now()
 WHERE (c.batch_id, c.message_id) IN (
        SELECT l.batch_id, l.message_id FROM {schema}.batch_children AS l
         WHERE l.batch_id = %(id)s AND l.state = 'pending'
           FOR UPDATE SKIP LOCKED)
RETURNING c.message_id
