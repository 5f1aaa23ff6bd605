-- Whether a key is paused now, for a job that holds a reserved slot: a 429 that came after the
-- reservation moves the job past the pause instead of letting it call the provider during it.
SELECT ceil(extract(epoch FROM paused_until - statement_timestamp()) * 1000)::bigint AS paused_ms
FROM {schema}.rate_limit_buckets
WHERE key = %(key)s AND paused_until > statement_timestamp()
