-- Bounded batches keep each delete short; SKIP LOCKED steps over a key a claim is taking over.
-- The caller loops until a batch comes back short.
DELETE FROM {schema}.processed_jobs
WHERE (actor_name, job_key) IN (
    SELECT actor_name, job_key FROM {schema}.processed_jobs
    WHERE expires_at <= now()
    ORDER BY expires_at
    LIMIT %(batch_size)s
    FOR UPDATE SKIP LOCKED
)
