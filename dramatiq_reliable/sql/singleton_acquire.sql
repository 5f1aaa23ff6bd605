-- Take the lease on a key that is free or whose holder stopped renewing it; no row back means held.
-- A lapsed lease keeps its buffered message: the new holder hands it on when it releases.
INSERT INTO {schema}.singleton_leases AS lease (key, token, message_id, owner, expires_at)
VALUES (%(key)s, nextval(%(tokens)s::regclass), %(message_id)s, %(owner)s,
        now() + %(lease_ms)s * interval '1 millisecond')
ON CONFLICT (key) DO UPDATE
   SET token = EXCLUDED.token,
       message_id = EXCLUDED.message_id,
       owner = EXCLUDED.owner,
       acquired_at = now(),
       expires_at = EXCLUDED.expires_at
 WHERE lease.expires_at < now()
RETURNING lease.token, lease.buffered_message_id = %(message_id)s AS was_buffered
