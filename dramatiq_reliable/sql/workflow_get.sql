-- One workflow's row, by id.
SELECT w.id, w.if_step_dies, w.stages, w.stage, w.state, w.error, w.cancelled_by, w.created_at, w.finished_at,
       w.failure_actor
  FROM {schema}.workflows AS w
 WHERE w.id = %(id)s
