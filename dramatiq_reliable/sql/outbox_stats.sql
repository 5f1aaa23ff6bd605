SELECT count(*) AS backlog,
       count(*) FILTER (WHERE attempts > 0) AS failing,
       coalesce(extract(epoch FROM now() - min(created_at)), 0)::double precision AS oldest_age_s
FROM {schema}.outbox
WHERE published_at IS NULL
