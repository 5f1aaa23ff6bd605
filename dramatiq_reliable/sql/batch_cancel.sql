-- Cancel a batch that has not finished, under its row's lock taken FOR UPDATE (an adding
-- transaction holds FOR KEY SHARE: the cancel waits for it, and an add after the cancel sees
-- 'cancelled'; a plain UPDATE's lock would not conflict with the add's).  Sealed too, so nothing
-- is added later.  No row: it has finished or been cancelled already (or it is unknown).
WITH locked AS (
    SELECT x.id FROM {schema}.batches AS x WHERE x.id = %(id)s AND x.outcome IS NULL FOR UPDATE
)
UPDATE {schema}.batches AS b
   SET outcome = 'cancelled', cancelled_at = now(), cancelled_by = %(by)s, cancel_reason = %(reason)s,
       sealed_at = coalesce(b.sealed_at, now())
  FROM locked
 WHERE b.id = locked.id
RETURNING b.id
