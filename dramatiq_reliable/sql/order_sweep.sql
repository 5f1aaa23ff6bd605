-- Free the keys of killed workers and of discarded dead heads; their parked heads come back to be sent.
SELECT message_id, queue_name, body FROM {schema}.order_sweep(%(limit)s)
