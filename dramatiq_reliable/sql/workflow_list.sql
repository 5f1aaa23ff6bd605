-- The newest workflows (in one state, or any), for the page's list and 'workflows list'.
SELECT w.id, w.state, w.if_step_dies, w.stage, w.stages, w.error, w.created_at, w.finished_at
  FROM {schema}.workflows AS w
 WHERE %(state)s::text IS NULL OR w.state = %(state)s::text
 ORDER BY w.created_at DESC, w.id
 LIMIT %(limit)s
