-- The filter of DeadLetterFilter, written once and composed into every dead-letter listing and
-- bulk command in place of its filter placeholder.  Every condition is "NULL or equal": run unprepared, Postgres plans
-- with the actual values, folds the unused ones away and picks the partial index of the one in use.
(%(actor_name)s::text IS NULL OR actor_name = %(actor_name)s::text)
AND (%(queue_name)s::text IS NULL OR queue_name = %(queue_name)s::text)
AND (%(error_type)s::text IS NULL OR error_type = %(error_type)s::text)
AND (%(fingerprint)s::text IS NULL OR fingerprint = %(fingerprint)s::text)
AND (%(since)s::timestamptz IS NULL OR last_failed_at >= %(since)s::timestamptz)
AND (%(until)s::timestamptz IS NULL OR last_failed_at < %(until)s::timestamptz)
