-- The transactional outbox: one row per message sent inside an application transaction.
CREATE TABLE {schema}.outbox (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id    text        NOT NULL,
    -- routing key: the queue, or its delay queue (".DQ") for a delayed message
    queue_name    text        NOT NULL,
    actor_name    text        NOT NULL,
    -- the encoded message exactly as RabbitMQ will receive it
    body          bytea       NOT NULL,
    priority      smallint,
    eta           timestamptz,
    created_at    timestamptz NOT NULL DEFAULT now(),
    -- a row that failed on its own waits until then; a broker outage does not move it
    available_at  timestamptz NOT NULL DEFAULT now(),
    published_at  timestamptz,
    attempts      integer     NOT NULL DEFAULT 0,
    last_error    text
);

-- The relay reads only unpublished rows, in id order: this index stays as small as the backlog.
CREATE INDEX outbox_unpublished ON {schema}.outbox (id) WHERE published_at IS NULL;
-- Retention purges published rows by age.
CREATE INDEX outbox_published_at ON {schema}.outbox (published_at) WHERE published_at IS NOT NULL;

-- One NOTIFY per inserting statement, delivered on commit, wakes the relays.
CREATE FUNCTION {schema}.outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(TG_TABLE_SCHEMA || '.outbox', '');
    RETURN NULL;
END
$$;

CREATE TRIGGER outbox_notify AFTER INSERT ON {schema}.outbox
    FOR EACH STATEMENT EXECUTE FUNCTION {schema}.outbox_notify();
