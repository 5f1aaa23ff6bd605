-- Newest first, keyset-paginated on (last_failed_at, id).  Every filter is "NULL or equal": run
-- unprepared, Postgres plans with the actual values, folds the unused filters away and picks the
-- partial index of the one in use.
SELECT id, message_id, queue_name, actor_name, error_type, left(error_message, 500) AS error_message, attempts, reason,
       http_status, fingerprint, culprit, state, sent_at, first_failed_at, last_failed_at,
       worker_host, worker_pid, captures, handled_at, handled_by, note, replayed_to
FROM {schema}.dead_letters
WHERE (%(state)s::text IS NULL OR state = %(state)s::text)
  AND {filter}
  AND (%(before_at)s::timestamptz IS NULL
       OR (last_failed_at, id) < (%(before_at)s::timestamptz, %(before_id)s::bigint))
ORDER BY last_failed_at DESC, id DESC
LIMIT %(limit)s
