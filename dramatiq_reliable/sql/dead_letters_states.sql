-- Why requested ids were not handled: missing ids are absent from the result.
SELECT id, state, handled_at,
       %(max_age_s)s::double precision IS NOT NULL
           AND sent_at < now() - make_interval(secs => %(max_age_s)s::double precision) AS too_old
FROM {schema}.dead_letters
WHERE id = ANY(%(ids)s::bigint[])
