-- The newest batches (all, or those in one state), each with its counts summed over its shards.
-- The limit applies to the batches first, so the shards are read for the rows shown only.
SELECT b.id, b.if_child_dies, b.callback_actor, b.created_at, b.sealed_at, b.fired_at, b.outcome,
       b.cancelled_at, b.cancelled_by, b.cancel_reason,
       coalesce(s.total, 0)::bigint AS total,
       coalesce(s.pending, 0)::bigint AS pending,
       coalesce(s.dead, 0)::bigint AS dead
  FROM (SELECT x.*
          FROM {schema}.batches AS x
         WHERE %(state)s::text IS NULL
            OR (%(state)s = 'open' AND x.sealed_at IS NULL)
            OR (%(state)s = 'running' AND x.sealed_at IS NOT NULL AND x.outcome IS NULL)
            OR x.outcome = %(state)s
         ORDER BY x.created_at DESC, x.id
         LIMIT %(limit)s) AS b
  LEFT JOIN LATERAL (SELECT sum(h.total) AS total, sum(h.pending) AS pending, sum(h.dead) AS dead
                       FROM {schema}.batch_shards AS h
                      WHERE h.batch_id = b.id) AS s ON true
 ORDER BY b.created_at DESC, b.id
