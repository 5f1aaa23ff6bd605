-- Per queue: messages ready now, delayed, held by a consumer, and the age of the oldest ready one.
SELECT queue_name,
       count(*) FILTER (WHERE available_at <= now()),
       count(*) FILTER (WHERE available_at > now() AND lease IS NULL),
       count(*) FILTER (WHERE available_at > now() AND lease IS NOT NULL),
       extract(epoch FROM now() - min(enqueued_at) FILTER (WHERE available_at <= now()))::double precision
FROM {schema}.queue
WHERE queue_name NOT LIKE '%%.XQ'
GROUP BY queue_name
ORDER BY queue_name
