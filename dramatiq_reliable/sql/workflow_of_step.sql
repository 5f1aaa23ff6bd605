-- The workflow a message is a step of, for 'jobs show' (by the message-id index).
SELECT s.workflow_id, s.stage, s.position, s.state AS step_state, w.state, w.stages
  FROM {schema}.workflow_steps AS s
  JOIN {schema}.workflows AS w ON w.id = s.workflow_id
 WHERE s.message_id = %(message_id)s
 LIMIT 1
