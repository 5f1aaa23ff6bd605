-- Before a delivered message runs (Cancellation middleware): one primary-key look-up.  A hit
-- also records that a worker honoured the tombstone; a miss writes nothing.
UPDATE {schema}.job_cancellations
SET honoured_at = coalesce(honoured_at, now()), honoured_how = coalesce(honoured_how, 'skipped')
WHERE message_id = %(message_id)s
RETURNING cancelled_by, cancelled_at
