-- Free the key after a run; when the job is done, the next job of the key is sent again if it was parked (1 back).
SELECT {schema}.order_release(%(lock_prefix)s, %(key)s, %(seq)s, %(token)s, %(done)s, %(target)s, %(channel)s) AS woken
