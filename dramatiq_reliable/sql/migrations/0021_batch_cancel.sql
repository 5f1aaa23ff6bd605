-- Cancelling a batch (workflows/batch_cancel.py), and the children found by message id.
--
-- A cancelled batch has the outcome 'cancelled': it never fires (neither the callback nor
-- on_failure), it takes no more children, and its children not finished when it was cancelled
-- are 'cancelled' (their jobs cancelled in the same transaction).  The counter shards are not
-- touched: a child finishing at that moment holds its shard's row and then waits for the batch's
-- row, which the cancel holds, so the cancel must not wait for a shard (it would deadlock).
ALTER TABLE {schema}.batches
    ADD COLUMN cancelled_at  timestamptz,
    ADD COLUMN cancelled_by  text,
    ADD COLUMN cancel_reason text,
    DROP CONSTRAINT batches_outcome,
    ADD CONSTRAINT batches_outcome CHECK (outcome IN ('succeeded', 'failed', 'cancelled'));

ALTER TABLE {schema}.batch_children
    DROP CONSTRAINT batch_children_state,
    ADD CONSTRAINT batch_children_state CHECK (state IN ('pending', 'done', 'dead', 'cancelled'));

-- The job page's "this job is a child of batch ...", for a child whose message Postgres no longer
-- holds (finished on a PostgresBroker).  message_id never changes, so a child's one update
-- (its state) stays HOT.
CREATE INDEX batch_children_message ON {schema}.batch_children (message_id);

-- As in 0015, and a cancelled batch says so ('cancelled') rather than 'sealed'.
CREATE OR REPLACE FUNCTION {schema}.batch_add(p_batch_id text, p_message_id text)
RETURNS text LANGUAGE plpgsql SET search_path TO {schema}, pg_catalog AS $$
DECLARE
    b record;
    s smallint := (hashtext(p_message_id) & 127)::smallint;
BEGIN
    SELECT x.sealed_at, x.outcome INTO b FROM batches AS x WHERE x.id = p_batch_id FOR KEY SHARE;
    IF NOT FOUND THEN
        RETURN 'unknown';
    END IF;
    IF b.outcome = 'cancelled' THEN
        RETURN 'cancelled';
    END IF;
    IF b.sealed_at IS NOT NULL THEN
        RETURN 'sealed';
    END IF;
    INSERT INTO batch_children (batch_id, message_id, shard) VALUES (p_batch_id, p_message_id, s)
    ON CONFLICT DO NOTHING;
    IF NOT FOUND THEN
        RETURN 'duplicate';
    END IF;
    INSERT INTO batch_shards AS h (batch_id, shard, total, pending) VALUES (p_batch_id, s, 1, 1)
    ON CONFLICT (batch_id, shard) DO UPDATE SET total = h.total + 1, pending = h.pending + 1;
    RETURN 'added';
END $$;

-- As in 0015, and a batch with an outcome (a cancelled one too) never fires: a child that
-- finishes after the cancel, or was finishing during it, sends nothing.
CREATE OR REPLACE FUNCTION {schema}.batch_try_fire(p_batch_id text, p_target text, p_channel text)
RETURNS text LANGUAGE plpgsql SET search_path TO {schema}, pg_catalog AS $$
DECLARE
    b record;
    n_dead bigint;
BEGIN
    SELECT * INTO b FROM batches AS x WHERE x.id = p_batch_id FOR UPDATE;
    IF NOT FOUND OR b.sealed_at IS NULL OR b.fired_at IS NOT NULL OR b.outcome IS NOT NULL THEN
        RETURN 'waiting';
    END IF;
    IF EXISTS (SELECT 1 FROM batch_shards AS h WHERE h.batch_id = p_batch_id AND h.pending > 0) THEN
        RETURN 'waiting';
    END IF;
    SELECT coalesce(sum(h.dead), 0) INTO n_dead FROM batch_shards AS h WHERE h.batch_id = p_batch_id;
    IF n_dead > 0 AND b.if_child_dies = 'fail' THEN
        UPDATE batches AS x SET fired_at = now(), outcome = 'failed' WHERE x.id = p_batch_id;
        IF b.failure_body IS NOT NULL THEN
            PERFORM flow_resend(p_target, p_channel, b.failure_message_id, b.failure_queue, b.failure_actor, b.failure_body);
        END IF;
        RETURN 'failed';
    END IF;
    UPDATE batches AS x SET fired_at = now(), outcome = 'succeeded' WHERE x.id = p_batch_id;
    PERFORM flow_resend(p_target, p_channel, b.callback_message_id, b.callback_queue, b.callback_actor, b.callback_body);
    RETURN 'fired';
END $$;
