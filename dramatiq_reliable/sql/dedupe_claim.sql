-- Take the dedupe key for this message, or find the message that holds it.  One statement: a
-- second sender with the same key waits on the unique key until the first commits or rolls back.
-- The update always runs (it locks the row for this transaction) but changes the holder only when
-- the key expired; RETURNING gives the message id that holds the key now (this one: send it).
INSERT INTO {schema}.send_dedupe AS held (actor_name, dedupe_key, message_id, expires_at)
VALUES (%(actor_name)s, %(dedupe_key)s, %(message_id)s,
        now() + %(window_ms)s * interval '1 millisecond')
ON CONFLICT (actor_name, dedupe_key) DO UPDATE
SET message_id = CASE WHEN held.expires_at <= now() THEN excluded.message_id ELSE held.message_id END,
    created_at = CASE WHEN held.expires_at <= now() THEN excluded.created_at ELSE held.created_at END,
    expires_at = CASE WHEN held.expires_at <= now() THEN excluded.expires_at ELSE held.expires_at END
RETURNING held.message_id
