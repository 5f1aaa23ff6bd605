-- is_cancelled(): whether a running job's message was cancelled; one primary-key look-up.
SELECT cancelled_by FROM {schema}.job_cancellations WHERE message_id = %(message_id)s
