-- For status: the keys with parked messages, how many wait and how many run.
SELECT p.key, count(*) AS parked,
       (SELECT count(*) FROM {schema}.concurrency_slots AS s WHERE s.key = p.key AND s.expires_at > now()) AS running,
       min(p.parked_at) AS oldest_parked_at
  FROM {schema}.concurrency_parked AS p
 GROUP BY p.key
 ORDER BY count(*) DESC, p.key
 LIMIT %(limit)s
