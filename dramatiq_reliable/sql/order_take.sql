-- At consume time: run the key's head, park a job before its turn, or tell a finished job's redelivery.
SELECT outcome, key, seq, token
  FROM {schema}.order_take(%(lock_prefix)s, %(message_id)s, %(owner)s, %(lease_ms)s, %(queue_name)s, %(body)s,
                           %(priority)s::smallint, %(async)s, true)
