-- One batch's children (all, or those in one state): dead first, then pending, then the latest
-- finished; what a person looks for in a batch that does not finish.
SELECT c.message_id, c.state, c.finished_at
  FROM {schema}.batch_children AS c
 WHERE c.batch_id = %(id)s AND (%(state)s::text IS NULL OR c.state = %(state)s)
 ORDER BY CASE c.state WHEN 'dead' THEN 0 WHEN 'pending' THEN 1 ELSE 2 END, c.finished_at DESC NULLS LAST, c.message_id
 LIMIT %(limit)s
