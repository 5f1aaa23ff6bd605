-- Free this run's slot; the oldest parked message of the key is sent again in the same statement (1 back).
SELECT {schema}.concurrency_release(%(lock)s, %(key)s, %(token)s, %(target)s, %(channel)s) AS woken
