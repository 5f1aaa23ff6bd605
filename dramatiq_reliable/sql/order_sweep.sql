-- Free the keys of killed workers and of discarded dead heads; their parked heads are sent again (how many back).
SELECT {schema}.order_sweep(%(lock_prefix)s, %(limit)s, %(target)s, %(channel)s) AS woken
