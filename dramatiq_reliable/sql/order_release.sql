-- Free the key after a run; when the job is done, the next job of the key comes back if it was parked.
SELECT message_id, queue_name, body FROM {schema}.order_release(%(key)s, %(seq)s, %(token)s, %(done)s)
