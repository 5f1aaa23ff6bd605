-- Dead rows grouped by fingerprint (error type + innermost user frame): one bug, one row,
-- however many messages it killed.  Details come from the group's newest row.
WITH groups AS (
    SELECT fingerprint,
           count(*) AS dead,
           count(DISTINCT actor_name) AS actors,
           min(first_failed_at) AS first_failed_at,
           max(last_failed_at) AS last_failed_at,
           max(id) AS latest_id
    FROM {schema}.dead_letters
    WHERE state = 'dead'
      AND {filter}
    GROUP BY fingerprint
    ORDER BY dead DESC, last_failed_at DESC
    LIMIT %(limit)s
)
-- Column names are DeadLetterGroup's fields: rows map to it by name.
SELECT g.fingerprint, g.dead AS count, g.actors, g.first_failed_at, g.last_failed_at,
       d.error_type, d.culprit, d.actor_name, d.queue_name, left(d.error_message, 500) AS error_message,
       d.id AS latest_id
FROM groups AS g
JOIN {schema}.dead_letters AS d ON d.id = g.latest_id
ORDER BY g.dead DESC, g.last_failed_at DESC
