-- Per queue: messages ready now, delayed, held by a consumer, dead (".XQ", folded into their
-- queue), and the age of the oldest ready one.
SELECT CASE WHEN queue_name LIKE '%%.XQ' THEN left(queue_name, -3) ELSE queue_name END AS queue_name,
       count(*) FILTER (WHERE queue_name NOT LIKE '%%.XQ' AND available_at <= now()) AS ready,
       count(*) FILTER (WHERE queue_name NOT LIKE '%%.XQ' AND available_at > now() AND lease IS NULL) AS delayed,
       count(*) FILTER (WHERE queue_name NOT LIKE '%%.XQ' AND available_at > now() AND lease IS NOT NULL) AS held,
       count(*) FILTER (WHERE queue_name LIKE '%%.XQ') AS dead,
       extract(epoch FROM now() - min(enqueued_at)
           FILTER (WHERE queue_name NOT LIKE '%%.XQ' AND available_at <= now()))::double precision AS oldest_ready_s
FROM {schema}.queue
GROUP BY 1
ORDER BY 1
