-- Producers' queue inserts no longer notify (PostgresBroker): a transaction that ran NOTIFY takes
-- a cluster-wide lock at commit, so the statement trigger of 0004 serialised every producer's
-- commit with every other's, as the outbox trigger did before 0006.  Consumers wake themselves
-- instead: a claim that found rows claims again at once, an empty one sleeps a short, growing,
-- jittered delay up to the broker's poll_interval_ms; a send in the consumers' own process wakes
-- them directly.  Their LISTEN stays, for explicit wake-ups (a NOTIFY on "<schema>.queue" with
-- the queue's name as payload, or an empty payload for every queue).
--
-- The trigger's last use: one empty-payload NOTIFY, delivered when this migration commits, so
-- workers that were waiting for the schema (or running code that still waits on notifications)
-- look at once instead of at their next poll.  A statement-level trigger fires for an INSERT
-- that adds no row; the replaced function notifies with no payload whatever was inserted.
CREATE OR REPLACE FUNCTION {schema}.queue_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(TG_TABLE_SCHEMA || '.queue', '');
    RETURN NULL;
END
$$;
INSERT INTO {schema}.queue (queue_name, message_id, actor_name, body) SELECT '', '', '', '' WHERE false;

DROP TRIGGER IF EXISTS queue_notify ON {schema}.queue;
DROP FUNCTION IF EXISTS {schema}.queue_notify();
