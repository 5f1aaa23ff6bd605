-- A worker skipped a delivery of a cancelled message: record it for 'jobs show'.
UPDATE {schema}.job_cancellations
SET honoured_at = coalesce(honoured_at, now()), honoured_how = coalesce(honoured_how, 'skipped')
WHERE message_id = %(message_id)s
