-- Cancel a running workflow under its row's lock (a finishing stage waits for it, then sees the
-- state and sends nothing); its waiting steps never will be sent.  The steps already sent and
-- not finished come back, for the job cancel.  No row: it is not running (or unknown).
WITH w AS (
    UPDATE {schema}.workflows AS x
       SET state = 'cancelled', cancelled_by = %(by)s, error = %(reason)s, finished_at = now()
     WHERE x.id = %(id)s AND x.state = 'running'
    RETURNING x.id
), waiting AS (
    UPDATE {schema}.workflow_steps AS s SET state = 'cancelled', finished_at = now()
      FROM w
     WHERE s.workflow_id = w.id AND s.state = 'waiting'
    RETURNING s.message_id
)
SELECT w.id, (SELECT count(*) FROM waiting) AS never_sent FROM w
