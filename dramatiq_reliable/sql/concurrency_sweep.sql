-- Slots of killed workers lapse: each lapsed slot wakes one parked message of its key.
SELECT message_id, queue_name, body FROM {schema}.concurrency_sweep(%(lock_prefix)s, %(limit)s)
