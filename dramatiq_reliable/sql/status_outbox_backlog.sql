-- Unpublished rows only, so the partial index outbox_unpublished keeps this as small as the
-- backlog: cheap enough for a metrics scrape.  Delayed rows (queue "x.DQ") are reported as is;
-- the caller folds them into their queue.
SELECT queue_name,
       count(*) AS backlog,
       count(*) FILTER (WHERE attempts > 0) AS failing,
       extract(epoch FROM now() - min(created_at))::double precision AS oldest_age_s
FROM {schema}.outbox
WHERE published_at IS NULL
GROUP BY queue_name
