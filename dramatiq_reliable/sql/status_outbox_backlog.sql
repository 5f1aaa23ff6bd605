-- Unpublished rows only, so the partial index outbox_unpublished keeps this as small as the
-- backlog: cheap enough for a metrics scrape.  Delayed rows of an older version (queue "x.DQ")
-- are reported as is; the caller folds them into their queue.
-- "scheduled": rows waiting for their due time (a delayed send, a retry's backoff, a delayed
-- replay) that never failed: not a backlog, so a delay of an hour is no alarm.  The backlog is
-- the rest: due now, or failing.  Its age counts from when a row fell due (its eta, if later
-- than its commit), so a delayed row is not "an hour old" the moment it is due.
SELECT queue_name,
       count(*) FILTER (WHERE NOT scheduled) AS backlog,
       count(*) FILTER (WHERE scheduled) AS scheduled,
       count(*) FILTER (WHERE attempts > 0) AS failing,
       extract(epoch FROM now() - min(due_at) FILTER (WHERE NOT scheduled))::double precision AS oldest_age_s
FROM (
    SELECT queue_name, attempts,
           attempts = 0 AND available_at > now() AS scheduled,
           least(available_at, greatest(created_at, coalesce(eta, created_at))) AS due_at
    FROM {schema}.outbox
    WHERE published_at IS NULL
) AS unpublished
GROUP BY queue_name
