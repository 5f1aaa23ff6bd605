-- A message that ran to completion under its default key (the message id).
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
  AND p.job_key = %(message_id)s AND p.message_id = %(message_id)s
LIMIT 1
