-- Dedupe at enqueue: one row per (actor, dedupe key) names the message a send with that key
-- wrote.  The row is written in the sender's transaction together with the message's own row,
-- so a rollback frees the key, and the unique key makes a concurrent second sender wait for the
-- first to commit or roll back.  A row past expires_at no longer dedupes: the next send with the
-- key takes it over; the purge deletes rows nobody took over.
CREATE TABLE {schema}.send_dedupe (
    actor_name  text        NOT NULL,
    dedupe_key  text        NOT NULL,
    -- the message the key dedupes to: what a second send inside the window returns
    message_id  text        NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL,
    PRIMARY KEY (actor_name, dedupe_key)
);

-- The purge deletes expired keys in batches, oldest first.
CREATE INDEX send_dedupe_expires_at ON {schema}.send_dedupe (expires_at);
