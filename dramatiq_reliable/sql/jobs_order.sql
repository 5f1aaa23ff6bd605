-- jobs show: a job of an order key parked in Postgres until its turn (at send, or delivered early).
SELECT j.key, j.sent_at, j.actor_name, j.queue_name,
       (SELECT count(*) FROM {schema}.order_jobs AS a WHERE a.key = j.key AND a.seq < j.seq) AS ahead,
       (SELECT h.message_id FROM {schema}.order_jobs AS h WHERE h.key = j.key ORDER BY h.seq LIMIT 1)
           AS head_message_id,
       (SELECT h.state FROM {schema}.order_jobs AS h WHERE h.key = j.key ORDER BY h.seq LIMIT 1) AS head_state
  FROM {schema}.order_jobs AS j
 WHERE j.message_id = %(message_id)s AND j.state = 'parked'
