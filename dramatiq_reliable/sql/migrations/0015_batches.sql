-- Batches (workflows/batch.py): children sent in the sender's transaction, a callback enqueued
-- exactly once in the transaction of the child that finishes last.
--
-- No hot row: a child counts itself on its own row (batch_children) and on one of 128 counter
-- shards (batch_shards, picked by a hash of its message id), so 8 worker threads rarely wait for
-- each other.  Only a child that brings its shard to zero (and the seal) locks the batch row and
-- looks at every shard: whoever takes that lock last sees every other shard's zero committed
-- (each locker holds it until it commits) and fires the callback.  A lost or doubled callback
-- would need two lockers each missing the other, which the lock rules out.
CREATE TABLE {schema}.batches (
    id                  text        PRIMARY KEY,
    -- 'fail': a dead child fails the batch (the failure message, if any, is sent instead of the
    -- callback); 'continue': a dead child counts as finished and the callback still runs
    if_child_dies       text        NOT NULL,
    callback_message_id text        NOT NULL,
    callback_actor      text        NOT NULL,
    callback_queue      text        NOT NULL,
    callback_body       bytea       NOT NULL,
    failure_message_id  text,
    failure_actor       text,
    failure_queue       text,
    failure_body        bytea,
    created_at          timestamptz NOT NULL DEFAULT now(),
    sealed_at           timestamptz,
    fired_at            timestamptz,
    -- 'succeeded' (the callback was sent) or 'failed' (a child died under 'fail')
    outcome             text,
    CONSTRAINT batches_if_child_dies CHECK (if_child_dies IN ('fail', 'continue')),
    CONSTRAINT batches_outcome CHECK (outcome IN ('succeeded', 'failed'))
);

CREATE TABLE {schema}.batch_shards (
    batch_id  text     NOT NULL REFERENCES {schema}.batches (id) ON DELETE CASCADE,
    shard     smallint NOT NULL,
    total     bigint   NOT NULL DEFAULT 0,
    pending   bigint   NOT NULL DEFAULT 0,
    dead      bigint   NOT NULL DEFAULT 0,
    PRIMARY KEY (batch_id, shard)
) WITH (fillfactor = 50);

CREATE TABLE {schema}.batch_children (
    batch_id     text        NOT NULL REFERENCES {schema}.batches (id) ON DELETE CASCADE,
    message_id   text        NOT NULL,
    shard        smallint    NOT NULL,
    -- pending, done, dead
    state        text        NOT NULL DEFAULT 'pending',
    finished_at  timestamptz,
    PRIMARY KEY (batch_id, message_id),
    CONSTRAINT batch_children_state CHECK (state IN ('pending', 'done', 'dead'))
) WITH (fillfactor = 70);  -- room on the page: a child's one update stays HOT (no index write)

-- Add one child, in the sender's transaction: 'added', 'duplicate' (already a child),
-- 'sealed' or 'unknown' (no such batch visible here: its transaction rolled back or is another
-- one).  A status, not an error, so the caller's transaction is not aborted.  FOR KEY SHARE
-- waits for a seal in progress and lets other adds and the counting run.
CREATE FUNCTION {schema}.batch_add(p_batch_id text, p_message_id text)
RETURNS text LANGUAGE plpgsql SET search_path TO {schema}, pg_catalog AS $$
DECLARE
    was_sealed timestamptz;
    s smallint := (hashtext(p_message_id) & 127)::smallint;
BEGIN
    SELECT b.sealed_at INTO was_sealed FROM batches AS b WHERE b.id = p_batch_id FOR KEY SHARE;
    IF NOT FOUND THEN
        RETURN 'unknown';
    END IF;
    IF was_sealed IS NOT NULL THEN
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

-- Fire the batch if it is sealed, not fired and no shard has a pending child: the callback (or,
-- under 'fail' with a dead child, the failure message) becomes a row of the outbox or queue
-- table in this transaction.  'fired', 'failed' or 'waiting'.  The batch row's lock comes first;
-- the statements after it see every commit made before the lock was granted.
CREATE FUNCTION {schema}.batch_try_fire(p_batch_id text, p_target text, p_channel text)
RETURNS text LANGUAGE plpgsql SET search_path TO {schema}, pg_catalog AS $$
DECLARE
    b record;
    n_dead bigint;
BEGIN
    SELECT * INTO b FROM batches AS x WHERE x.id = p_batch_id FOR UPDATE;
    IF NOT FOUND OR b.sealed_at IS NULL OR b.fired_at IS NOT NULL THEN
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

-- A child finished (p_dead: it died), in its own job's transaction: 'duplicate' when it was
-- counted already (a redelivery), 'fired' or 'failed' when it finished the batch, else 'counted'.
CREATE FUNCTION {schema}.batch_finish(p_batch_id text, p_message_id text, p_dead boolean, p_target text, p_channel text)
RETURNS text LANGUAGE plpgsql SET search_path TO {schema}, pg_catalog AS $$
DECLARE
    s smallint;
    still bigint;
    fired text;
BEGIN
    UPDATE batch_children AS c
       SET state = CASE WHEN p_dead THEN 'dead' ELSE 'done' END, finished_at = now()
     WHERE c.batch_id = p_batch_id AND c.message_id = p_message_id AND c.state = 'pending'
    RETURNING c.shard INTO s;
    IF NOT FOUND THEN
        RETURN 'duplicate';
    END IF;
    UPDATE batch_shards AS h SET pending = h.pending - 1, dead = h.dead + p_dead::int
     WHERE h.batch_id = p_batch_id AND h.shard = s
    RETURNING h.pending INTO still;
    IF still > 0 THEN
        RETURN 'counted';
    END IF;
    fired := batch_try_fire(p_batch_id, p_target, p_channel);
    RETURN CASE WHEN fired = 'waiting' THEN 'counted' ELSE fired END;
END $$;

-- Seal: no child can be added after this, and the callback can fire (at once for an empty or
-- finished batch).  'sealed' (now or before) plus what batch_try_fire says, or 'unknown'.
CREATE FUNCTION {schema}.batch_seal(p_batch_id text, p_target text, p_channel text)
RETURNS text LANGUAGE plpgsql SET search_path TO {schema}, pg_catalog AS $$
BEGIN
    UPDATE batches AS x SET sealed_at = coalesce(x.sealed_at, now()) WHERE x.id = p_batch_id;
    IF NOT FOUND THEN
        RETURN 'unknown';
    END IF;
    RETURN batch_try_fire(p_batch_id, p_target, p_channel);
END $$;
