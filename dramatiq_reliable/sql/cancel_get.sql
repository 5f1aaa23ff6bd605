-- A message's cancellation, if any.
SELECT message_id, cancelled_at, cancelled_by, reason, found_in, honoured_at, honoured_how
FROM {schema}.job_cancellations
WHERE message_id = %(message_id)s
