-- Take a slot of the key (the fencing token back) or park the message (NULL back): one call, under the key's lock.
SELECT {schema}.concurrency_take(%(lock)s, %(key)s, %(limit)s, %(message_id)s, %(actor_name)s, %(owner)s,
                                 %(lease_ms)s, %(queue_name)s, %(body)s, %(priority)s::smallint) AS token
