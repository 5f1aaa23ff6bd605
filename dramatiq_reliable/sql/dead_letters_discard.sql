-- One batch of a discard: the rows stay, marked, for the audit trail until purged.
WITH picked AS (
    SELECT id, last_failed_at
    FROM {schema}.dead_letters
    WHERE state = 'dead'
      AND id <= %(upto_id)s
      AND (%(after_at)s::timestamptz IS NULL
           OR (last_failed_at, id) > (%(after_at)s::timestamptz, %(after_id)s::bigint))
      AND (%(ids)s::bigint[] IS NULL OR id = ANY(%(ids)s::bigint[]))
      AND {filter}
    ORDER BY last_failed_at, id
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
), discarded AS (
    UPDATE {schema}.dead_letters AS d
    SET state = 'discarded', handled_at = now(), handled_by = %(handled_by)s, note = %(note)s
    -- = ANY(ARRAY(...)): primary-key lookups, never a hash join over the whole table
    WHERE d.id = ANY(ARRAY(SELECT id FROM picked))
    RETURNING d.id
)
SELECT (SELECT count(*) FROM discarded) AS handled, last.last_failed_at, last.id AS last_id
FROM (SELECT 1) AS one
LEFT JOIN LATERAL (SELECT last_failed_at, id FROM picked ORDER BY last_failed_at DESC, id DESC LIMIT 1) AS last ON TRUE
