-- Dead rows by actor and error type, for status pages, alerts and metrics.
SELECT actor_name, error_type, count(*) AS count, min(last_failed_at) AS oldest_failed_at,
       max(last_failed_at) AS newest_failed_at
FROM {schema}.dead_letters
WHERE state = 'dead'
GROUP BY actor_name, error_type
ORDER BY count(*) DESC, actor_name, error_type
