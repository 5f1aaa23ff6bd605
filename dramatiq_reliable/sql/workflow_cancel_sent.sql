-- After the cancel: the steps sent and not finished are cancelled too (their jobs are cancelled
-- by message id in the same transaction).
UPDATE {schema}.workflow_steps AS s SET state = 'cancelled', finished_at = now()
 WHERE s.workflow_id = %(id)s AND s.state = 'sent'
RETURNING s.message_id
