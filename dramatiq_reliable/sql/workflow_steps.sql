-- One workflow's steps in order, with their stage's kind; results are small by construction.
SELECT s.stage, s.position, g.is_group, s.message_id, s.actor_name, s.queue_name, s.state, s.result,
       s.sent_at, s.finished_at
  FROM {schema}.workflow_steps AS s
  JOIN {schema}.workflow_stages AS g ON g.workflow_id = s.workflow_id AND g.stage = s.stage
 WHERE s.workflow_id = %(id)s
 ORDER BY s.stage, s.position
