-- queue_insert.sql behind a dedupe key, in one round trip: take the key (or find the message that
-- holds it) and write the row only when this message holds it; returns the holder's message id.
-- A second sender with the same key waits on the unique key until the first commits or rolls
-- back.  The update always runs (it locks the key for this transaction) but changes the holder
-- only once the key expired.  The claim is the same in outbox_ and queue_insert_dedupe.sql.
WITH claim AS (
    INSERT INTO {schema}.send_dedupe AS held (actor_name, dedupe_key, message_id, expires_at)
    VALUES (%(actor_name)s, %(dedupe_key)s, %(message_id)s, now() + %(window_ms)s * interval '1 millisecond')
    ON CONFLICT (actor_name, dedupe_key) DO UPDATE
    SET message_id = CASE WHEN held.expires_at <= now() THEN excluded.message_id ELSE held.message_id END,
        created_at = CASE WHEN held.expires_at <= now() THEN excluded.created_at ELSE held.created_at END,
        expires_at = CASE WHEN held.expires_at <= now() THEN excluded.expires_at ELSE held.expires_at END
    RETURNING held.message_id
), sent AS (
    INSERT INTO {schema}.queue (queue_name, message_id, actor_name, body, priority, available_at)
    SELECT %(queue_name)s, %(message_id)s, %(actor_name)s, %(body)s, %(priority)s,
           coalesce(to_timestamp(%(eta_ms)s::double precision / 1000), now())
    FROM claim WHERE claim.message_id = %(message_id)s
)
SELECT message_id FROM claim
