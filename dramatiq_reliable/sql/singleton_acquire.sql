-- Take the lease on a key that is free or whose holder stopped renewing it.  token is NULL when
-- the key is held, or when the leases are in quarantine after a Postgres crash (quarantined:
-- true, with the milliseconds left; a missing guard row means the crash was just noticed).
-- A lapsed lease keeps its buffered message: the new holder hands it on when it releases.
--
-- The commit does not wait for the WAL flush (synchronous_commit off for this transaction
-- alone): that flush was most of a singleton run's cost.  A crash that loses this commit empties
-- the unlogged guard row too, and no key is handed out again until the quarantine is over;
-- singleton.py says why that is as safe as a flushed acquire.
--
-- A key held by a job transaction (singleton_acquire_txn.sql) is a committed row locked by it:
-- ON CONFLICT would wait for that job, so a row that exists but cannot be locked at once (SKIP
-- LOCKED) is held (locked: true) and nothing is inserted.
WITH guard AS (
    SELECT quarantine_until, quarantine_until < now() AS open
    FROM {schema}.singleton_guard
    WHERE id = 1
), existing AS (
    SELECT key FROM {schema}.singleton_leases WHERE key = %(key)s
), lockable AS (
    SELECT key FROM {schema}.singleton_leases WHERE key = %(key)s FOR UPDATE SKIP LOCKED
), taken AS (
    INSERT INTO {schema}.singleton_leases AS lease (key, token, message_id, owner, expires_at)
    SELECT %(key)s, nextval(%(tokens)s::regclass), %(message_id)s, %(owner)s,
           now() + %(lease_ms)s * interval '1 millisecond'
    FROM guard
    WHERE guard.open
      AND (NOT EXISTS (SELECT 1 FROM existing) OR EXISTS (SELECT 1 FROM lockable))
      AND set_config('synchronous_commit', 'off', true) IS NOT NULL
    ON CONFLICT (key) DO UPDATE
       SET token = EXCLUDED.token,
           message_id = EXCLUDED.message_id,
           owner = EXCLUDED.owner,
           acquired_at = now(),
           expires_at = EXCLUDED.expires_at
     WHERE lease.expires_at < now()
    RETURNING lease.token, lease.buffered_message_id = %(message_id)s AS was_buffered
)
SELECT taken.token,
       coalesce(taken.was_buffered, false) AS was_buffered,
       NOT coalesce((SELECT open FROM guard), false) AS quarantined,
       EXISTS (SELECT 1 FROM existing) AND NOT EXISTS (SELECT 1 FROM lockable) AS locked,
       (SELECT CASE WHEN open THEN 0 ELSE ceil(extract(epoch FROM quarantine_until - now()) * 1000)::bigint END
         FROM guard) AS quarantine_left_ms
FROM (SELECT 1) AS one
LEFT JOIN taken ON true
