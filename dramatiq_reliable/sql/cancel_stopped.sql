-- A running job stopped at a cancel checkpoint (JobCancelled): record it for 'jobs show'.
UPDATE {schema}.job_cancellations
SET honoured_at = now(), honoured_how = 'stopped'
WHERE message_id = %(message_id)s
