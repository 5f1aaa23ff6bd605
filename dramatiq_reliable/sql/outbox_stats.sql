-- The backlog is what the relay has to publish now (due, or failing); "scheduled" rows wait for
-- their due time (delays, retries' backoff) and are no backlog.  The age counts from when the
-- oldest backlog row fell due (see status_outbox_backlog.sql).
SELECT count(*) FILTER (WHERE NOT scheduled) AS backlog,
       count(*) FILTER (WHERE scheduled) AS scheduled,
       count(*) FILTER (WHERE attempts > 0) AS failing,
       coalesce(extract(epoch FROM now() - min(due_at) FILTER (WHERE NOT scheduled)), 0)::double precision
           AS oldest_age_s
FROM (
    SELECT attempts,
           attempts = 0 AND available_at > now() AS scheduled,
           least(available_at, greatest(created_at, coalesce(eta, created_at))) AS due_at
    FROM {schema}.outbox
    WHERE published_at IS NULL
) AS unpublished
