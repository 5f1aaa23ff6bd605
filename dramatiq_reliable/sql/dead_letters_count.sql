-- What a bulk replay or discard would touch: how many rows, how many are too old to replay
-- without force, and the highest id (the batches stop there, so rows that die meanwhile are
-- not swept up by a command that was confirmed for a smaller number).
SELECT count(*) AS total,
       count(*) FILTER (WHERE %(max_age_s)s::double precision IS NOT NULL
                          AND sent_at < now() - make_interval(secs => %(max_age_s)s::double precision)) AS too_old,
       coalesce(max(id), 0) AS upto
FROM {schema}.dead_letters
WHERE (%(state)s::text IS NULL OR state = %(state)s::text)
  AND (%(ids)s::bigint[] IS NULL OR id = ANY(%(ids)s::bigint[]))
  AND {filter}
