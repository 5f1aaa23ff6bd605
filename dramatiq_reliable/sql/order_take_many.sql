-- The takes of several worker threads in one transaction (one round trip, one commit), in the order
-- given; a key locked elsewhere comes back 'busy' instead of being waited for (take it alone).
SELECT t.outcome, t.key, t.seq, t.token
  FROM unnest(%(message_ids)s::text[], %(queue_names)s::text[], %(bodies)s::bytea[], %(priorities)s::smallint[])
       WITH ORDINALITY AS r (message_id, queue_name, body, priority, n)
 CROSS JOIN LATERAL {schema}.order_take(%(lock_prefix)s, r.message_id, %(owner)s, %(lease_ms)s, r.queue_name,
                                        r.body, r.priority, %(async)s, false) AS t
 ORDER BY r.n
