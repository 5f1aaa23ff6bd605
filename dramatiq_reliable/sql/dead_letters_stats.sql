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
      AND (%(actor_name)s::text IS NULL OR actor_name = %(actor_name)s::text)
      AND (%(queue_name)s::text IS NULL OR queue_name = %(queue_name)s::text)
      AND (%(error_type)s::text IS NULL OR error_type = %(error_type)s::text)
      AND (%(fingerprint)s::text IS NULL OR fingerprint = %(fingerprint)s::text)
      AND (%(since)s::timestamptz IS NULL OR last_failed_at >= %(since)s::timestamptz)
      AND (%(until)s::timestamptz IS NULL OR last_failed_at < %(until)s::timestamptz)
    GROUP BY fingerprint
    ORDER BY dead DESC, last_failed_at DESC
    LIMIT %(limit)s
)
SELECT g.fingerprint, g.dead, g.actors, g.first_failed_at, g.last_failed_at,
       d.error_type, d.culprit, d.actor_name, d.queue_name, left(d.error_message, 500), d.id
FROM groups AS g
JOIN {schema}.dead_letters AS d ON d.id = g.latest_id
ORDER BY g.dead DESC, g.last_failed_at DESC
