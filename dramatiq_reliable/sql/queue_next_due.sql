-- Seconds until the next row of one queue falls due (NULL: no row), by the server's clock: what
-- an idle consumer asks before a long sleep, so a delayed message (a retry's backoff, an eta, a
-- scheduler tick written ahead) is claimed when due, not up to poll_interval_ms later.  A claimed
-- row counts too (its available_at is its lease's end: a lapsed lease is claimable again then).
-- The claim's index (queue_name, priority DESC, available_at, id) is read once per priority
-- present in the queue (a loose index scan): a few index probes, however deep the queue.
WITH RECURSIVE priorities AS (
    (SELECT q.priority FROM {schema}.queue AS q
      WHERE q.queue_name = %(queue_name)s
      ORDER BY q.priority DESC LIMIT 1)
    UNION ALL
    SELECT (SELECT q.priority FROM {schema}.queue AS q
             WHERE q.queue_name = %(queue_name)s AND q.priority < p.priority
             ORDER BY q.priority DESC LIMIT 1)
      FROM priorities AS p
     WHERE p.priority IS NOT NULL
)
SELECT extract(epoch FROM min(
           (SELECT q.available_at FROM {schema}.queue AS q
             WHERE q.queue_name = %(queue_name)s AND q.priority = p.priority
             ORDER BY q.priority DESC, q.available_at LIMIT 1)
       ) - clock_timestamp())::double precision AS due_in_s
  FROM priorities AS p
 WHERE p.priority IS NOT NULL
