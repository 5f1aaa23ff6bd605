-- Free the keys of several runs in one transaction (one round trip, one commit), in the order given
-- (sorted by key: two batches never wait for each other's locks in opposite orders); how many woken.
SELECT coalesce(sum({schema}.order_release(%(lock_prefix)s, r.key, r.seq, r.token, r.done, %(target)s, %(channel)s)), 0)
           AS woken
  FROM unnest(%(keys)s::text[], %(seqs)s::bigint[], %(tokens)s::bigint[], %(dones)s::boolean[]) AS r (key, seq, token, done)
