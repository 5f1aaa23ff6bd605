-- Slots of killed workers lapse: each lapsed slot wakes one parked message of its key (how many back).
SELECT {schema}.concurrency_sweep(%(lock_prefix)s, %(limit)s, %(target)s, %(channel)s) AS woken
