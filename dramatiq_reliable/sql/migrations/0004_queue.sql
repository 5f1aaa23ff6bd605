-- Postgres queues (PostgresBroker): one row per message waiting, delayed, or held by a worker.
-- A row is visible to consumers when available_at has passed: a delayed message waits for its
-- eta there, and a claimed one for the end of its lease, so one index serves both and a worker
-- that dies loses nothing (its rows come back when their lease runs out).
CREATE TABLE {schema}.queue (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- the canonical queue name; a dead message (nacked with no dead-letter row) moves to "<queue>.XQ"
    queue_name    text        NOT NULL,
    message_id    text        NOT NULL,
    actor_name    text        NOT NULL,
    -- the encoded Dramatiq message, as a RabbitMQ consumer would receive it
    body          bytea       NOT NULL,
    -- broker_priority: higher runs first
    priority      smallint    NOT NULL DEFAULT 0,
    enqueued_at   timestamptz NOT NULL DEFAULT now(),
    available_at  timestamptz NOT NULL DEFAULT now(),
    -- the claim holding the row (a random token per claim), NULL while it waits; an ack, nack or
    -- heartbeat that does not carry the current token changes nothing
    lease         bigint,
    -- how many times a consumer claimed the row (more than 1: a redelivery after a lost lease)
    deliveries    integer     NOT NULL DEFAULT 0
)
-- Rows are short-lived: vacuum after a small share of them is dead, so acked rows do not pile up.
WITH (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_insert_scale_factor = 0.05);

-- The claim: the next visible rows of one queue, highest priority first, then oldest.
CREATE INDEX queue_ready ON {schema}.queue (queue_name, priority DESC, available_at, id);

-- One NOTIFY per queue per inserting statement, delivered on commit, wakes that queue's consumers.
CREATE FUNCTION {schema}.queue_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(TG_TABLE_SCHEMA || '.queue', q.queue_name)
    FROM (SELECT DISTINCT queue_name FROM inserted) AS q;
    RETURN NULL;
END
$$;

CREATE TRIGGER queue_notify AFTER INSERT ON {schema}.queue
    REFERENCING NEW TABLE AS inserted
    FOR EACH STATEMENT EXECUTE FUNCTION {schema}.queue_notify();
