-- Before a delivered message runs (Cancellation middleware): one primary-key look-up, read-only
-- (a miss, nearly every message, writes nothing).
SELECT cancelled_by FROM {schema}.job_cancellations WHERE message_id = %(message_id)s
