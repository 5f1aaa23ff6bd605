-- Partitioned history of published outbox rows (opt-in: 'dramatiq-reliable partitions enable').
-- Until a schema is enabled nothing writes here: the tables are empty and cost nothing.  Once it
-- is, a published row leaves the outbox in the relay's own marking statement and lands in the
-- partition of its published_at, so the hot table keeps only the backlog and retention drops
-- whole partitions (no DELETE, no dead tuples, no vacuum debt).  See dramatiq_reliable/partitions.py.

-- One row per partitioned table: how wide a partition is, how many are kept ready ahead of the
-- clock, how long rows are kept, and a short maintenance lease so two relays never run the same
-- DDL at once (a row, not a session lock: safe behind PgBouncer in transaction mode).
CREATE TABLE {schema}.partitioned_tables (
    table_name        text        PRIMARY KEY,
    interval_ms       bigint      NOT NULL,
    ahead             integer     NOT NULL,
    retention_ms      bigint      NOT NULL,
    enabled_at        timestamptz NOT NULL DEFAULT now(),
    maintained_at     timestamptz,
    maintenance_until timestamptz,
    -- the end of the newest partition: a relay moves rows it publishes before then itself
    covered_until     timestamptz,
    CONSTRAINT partitioned_tables_interval CHECK (interval_ms > 0),
    CONSTRAINT partitioned_tables_ahead CHECK (ahead >= 1),
    CONSTRAINT partitioned_tables_retention CHECK (retention_ms >= 0)
);

-- The outbox's columns, published_at required.  No primary key: the id was unique in the outbox
-- and a partitioned key would have to include published_at anyway; each index is paid for by
-- every publish, so only what readers use is kept.
CREATE TABLE {schema}.outbox_published (
    id            bigint      NOT NULL,
    message_id    text        NOT NULL,
    queue_name    text        NOT NULL,
    actor_name    text        NOT NULL,
    body          bytea       NOT NULL,
    priority      smallint,
    eta           timestamptz,
    created_at    timestamptz NOT NULL,
    available_at  timestamptz NOT NULL,
    published_at  timestamptz NOT NULL,
    attempts      integer     NOT NULL,
    last_error    text
) PARTITION BY RANGE (published_at);

-- 'jobs show ID' finds a published message by id; status and doctor read the newest publish.
CREATE INDEX outbox_published_message_id ON {schema}.outbox_published (message_id);
CREATE INDEX outbox_published_at_desc ON {schema}.outbox_published (published_at);

-- Moves the rows an UPDATE just marked published into the history (relays that know partitions
-- are enabled move them themselves, see outbox_move_published.sql; this catches every other
-- marking statement: older relays in a rolling deploy, drain_outbox, a relay that never purges), in the same statement (so in
-- the relay's own transaction: both or neither).  With no partition for their published_at yet
-- (maintenance fell behind the clock) the rows stay in the outbox, marked, as before
-- partitioning: the relay never fails a publish over retention, and the next maintenance moves them.
CREATE FUNCTION {schema}.outbox_move_published() RETURNS trigger LANGUAGE plpgsql
SET search_path TO {schema}, pg_catalog AS $$
BEGIN
    INSERT INTO outbox_published (id, message_id, queue_name, actor_name, body, priority, eta, created_at,
                                  available_at, published_at, attempts, last_error)
    SELECT id, message_id, queue_name, actor_name, body, priority, eta, created_at,
           available_at, published_at, attempts, last_error
    FROM marked WHERE published_at IS NOT NULL;
    IF FOUND THEN
        DELETE FROM outbox AS o USING marked AS m WHERE o.id = m.id AND m.published_at IS NOT NULL;
    END IF;
    RETURN NULL;
EXCEPTION WHEN check_violation THEN
    -- "no partition of relation found for row"
    RETURN NULL;
END $$;
