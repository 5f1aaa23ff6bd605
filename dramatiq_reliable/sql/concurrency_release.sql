-- Free this run's slot; the oldest parked message of the key comes back, to be sent in this transaction.
SELECT message_id, queue_name, body FROM {schema}.concurrency_release(%(lock)s, %(key)s, %(token)s)
