-- For status: the keys whose jobs wait, with the head's state (dead: the key is parked until it is replayed or discarded).
SELECT j.key, count(*) AS waiting,
       (array_agg(j.state ORDER BY j.seq))[1] AS head_state,
       (array_agg(j.message_id ORDER BY j.seq))[1] AS head_message_id,
       min(j.sent_at) AS oldest_sent_at
  FROM {schema}.order_jobs AS j
 GROUP BY j.key
HAVING count(*) > 1 OR bool_or(j.state = 'dead')
 ORDER BY bool_or(j.state = 'dead') DESC, count(*) DESC, j.key
 LIMIT %(limit)s
