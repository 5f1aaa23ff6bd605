-- For a job back at the token it reserved: how far ahead its slot still is (Postgres' clock, the
-- one every slot was given by, so no host's clock skews it) and how long the key stays paused:
-- a 429 that came after the reservation moves the job past the pause instead of letting it call.
SELECT ceil(%(slot_ms)s - extract(epoch FROM statement_timestamp()) * 1000)::bigint AS ahead_ms,
       coalesce((
           SELECT ceil(extract(epoch FROM paused_until - statement_timestamp()) * 1000)::bigint
           FROM {schema}.rate_limit_buckets
           WHERE key = %(key)s AND paused_until > statement_timestamp()
       ), 0) AS paused_ms
