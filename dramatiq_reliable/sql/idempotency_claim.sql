-- One statement claims a key: it inserts the key, or takes over a key whose retention has run
-- out, and returns a row only then.  A key another transaction inserted but has not committed
-- makes this statement wait on its row lock; after that commit it returns no row (a duplicate),
-- after a rollback it inserts.
INSERT INTO {schema}.processed_jobs AS p (actor_name, job_key, payload_hash, message_id, expires_at)
VALUES (%(actor_name)s, %(job_key)s, %(payload_hash)s, %(message_id)s, now() + make_interval(secs => %(retention_s)s))
ON CONFLICT (actor_name, job_key) DO UPDATE
    SET payload_hash = EXCLUDED.payload_hash,
        message_id   = EXCLUDED.message_id,
        created_at   = EXCLUDED.created_at,
        expires_at   = EXCLUDED.expires_at
    WHERE p.expires_at <= now()
RETURNING true
