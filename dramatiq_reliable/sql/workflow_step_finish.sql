-- A step done or dead, in its job's transaction; 'advance' names the stage to send now.
SELECT status, next_stage
  FROM {schema}.workflow_step_finish(%(workflow_id)s, %(message_id)s, %(dead)s, %(result)s, %(error)s,
                                     %(traceparent)s, %(target)s, %(channel)s)
