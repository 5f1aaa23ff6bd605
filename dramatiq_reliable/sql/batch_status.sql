-- Progress of one batch, by id: counts summed over its shards (no scan of its children).
SELECT b.id, b.if_child_dies, b.callback_actor, b.created_at, b.sealed_at, b.fired_at, b.outcome,
       b.cancelled_at, b.cancelled_by, b.cancel_reason,
       coalesce(sum(h.total), 0)::bigint AS total,
       coalesce(sum(h.pending), 0)::bigint AS pending,
       coalesce(sum(h.dead), 0)::bigint AS dead
  FROM {schema}.batches AS b
  LEFT JOIN {schema}.batch_shards AS h ON h.batch_id = b.id
 WHERE b.id = %(id)s
 GROUP BY b.id
