-- Dead letters not yet replayed or discarded, per queue, and how long ago the newest died.
-- The partial index dead_letters_dead_queue covers it.
SELECT queue_name,
       count(*) AS dead,
       extract(epoch FROM now() - max(last_failed_at))::double precision AS newest_age_s
FROM {schema}.dead_letters
WHERE state = 'dead'
GROUP BY queue_name
