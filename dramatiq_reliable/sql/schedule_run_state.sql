-- A worker records the run state of a scheduled message; the overlap policy reads it.
-- A finished tick (succeeded, failed, skipped) is never reopened by a late duplicate.
UPDATE {schema}.schedule_ticks
SET state = %(state)s,
    started_at = CASE WHEN %(state)s = 'running' THEN COALESCE(started_at, now()) ELSE started_at END,
    finished_at = CASE WHEN %(state)s IN ('succeeded', 'failed', 'skipped') THEN now() END,
    updated_at = now()
WHERE message_id = %(message_id)s
  AND state NOT IN ('succeeded', 'failed', 'skipped')
