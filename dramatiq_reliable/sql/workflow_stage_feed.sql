-- What the stage about to be sent needs: its steps' messages, and the finished stage's results
-- (in position order) and traceparents.
SELECT s.stage, s.position, s.message_id, s.body, s.state, s.result, s.traceparent, g.is_group
  FROM {schema}.workflow_steps AS s
  JOIN {schema}.workflow_stages AS g ON g.workflow_id = s.workflow_id AND g.stage = s.stage
 WHERE s.workflow_id = %(workflow_id)s AND s.stage IN (%(stage)s - 1, %(stage)s)
 ORDER BY s.stage, s.position
