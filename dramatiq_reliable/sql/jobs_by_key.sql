-- The message ids stored under an idempotency key, in any actor.  The primary key leads with
-- actor_name, so the few actor names are walked first (a loose index scan) and the key is then
-- found by (actor_name, job_key) in the index: no extra index taxes the processed-job insert.
WITH RECURSIVE actors AS (
    (SELECT actor_name FROM {schema}.processed_jobs ORDER BY actor_name LIMIT 1)
    UNION ALL
    SELECT (SELECT p.actor_name FROM {schema}.processed_jobs p
            WHERE p.actor_name > actors.actor_name ORDER BY p.actor_name LIMIT 1)
    FROM actors WHERE actors.actor_name IS NOT NULL
)
SELECT p.message_id, p.actor_name, p.job_key, p.created_at
FROM {schema}.processed_jobs p
WHERE p.actor_name IN (SELECT actor_name FROM actors WHERE actor_name IS NOT NULL)
  AND p.job_key = %(id)s
ORDER BY p.created_at DESC
