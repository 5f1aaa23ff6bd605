-- Bounded batches keep each delete short; SKIP LOCKED steps over a key a sender is taking over.
-- The caller loops until a batch comes back short.
DELETE FROM {schema}.send_dedupe
WHERE (actor_name, dedupe_key) IN (
    SELECT actor_name, dedupe_key FROM {schema}.send_dedupe
    WHERE expires_at <= now()
    ORDER BY expires_at
    LIMIT %(batch_size)s
    FOR UPDATE SKIP LOCKED
)
