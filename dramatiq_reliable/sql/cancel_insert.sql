-- Cancel: record the cancellation; a second cancel of the same message changes nothing.
INSERT INTO {schema}.job_cancellations (message_id, cancelled_by, reason, found_in)
VALUES (%(message_id)s, %(cancelled_by)s, %(reason)s, %(found_in)s)
ON CONFLICT (message_id) DO NOTHING
RETURNING cancelled_at
