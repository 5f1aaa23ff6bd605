-- After the cancel: the steps sent and not finished are cancelled too (their jobs are cancelled
-- by message id in the same transaction).  SKIP LOCKED: a step locked now is finishing in its
-- job's transaction; waiting for it could deadlock (it may wait for the workflow's row, held
-- here), and once it commits it sends nothing, as the workflow is cancelled.
UPDATE {schema}.workflow_steps AS s SET state = 'cancelled', finished_at = now()
 WHERE (s.workflow_id, s.stage, s.position) IN (
        SELECT l.workflow_id, l.stage, l.position FROM {schema}.workflow_steps AS l
         WHERE l.workflow_id = %(id)s AND l.state = 'sent'
           FOR UPDATE SKIP LOCKED)
RETURNING s.message_id
