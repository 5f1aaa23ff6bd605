-- Workflows (workflows/workflow.py): a chain of stages, each one step or a group of steps run in
-- parallel; a stage's results feed the next one.  A step's finish, the stage counter and the
-- next stage's messages commit in the step's own job transaction, so a crash neither loses the
-- next stage nor sends it twice.
CREATE TABLE {schema}.workflows (
    id                 text        PRIMARY KEY,
    -- what a dead step does: 'fail' the workflow, 'skip' it (counted as finished, its result
    -- null) or 'wait' for its dead letter to be replayed (the replay resumes the workflow)
    if_step_dies       text        NOT NULL,
    stages             integer     NOT NULL,
    -- the stage running now (0-based)
    stage              integer     NOT NULL DEFAULT 0,
    state              text        NOT NULL DEFAULT 'running',
    failure_message_id text,
    failure_actor      text,
    failure_queue      text,
    failure_body       bytea,
    -- why it failed ('step ... died', a result too large), or who cancelled it
    error              text,
    cancelled_by       text,
    created_at         timestamptz NOT NULL DEFAULT now(),
    finished_at        timestamptz,
    CONSTRAINT workflows_if_step_dies CHECK (if_step_dies IN ('fail', 'skip', 'wait')),
    CONSTRAINT workflows_state CHECK (state IN ('running', 'succeeded', 'failed', 'cancelled'))
);
-- The newest first, for the list on the page and 'workflows list'.
CREATE INDEX workflows_created_at ON {schema}.workflows (created_at DESC, id);

-- One row per stage: how many of its steps have not finished yet.  Each step of a group takes
-- this row's lock for one decrement until it commits; the step that brings it to zero is the
-- only one that sees zero (READ COMMITTED re-reads the row after the lock), and it sends the
-- next stage.  A group of thousands belongs in a Batch, whose counter is sharded.
CREATE TABLE {schema}.workflow_stages (
    workflow_id text    NOT NULL REFERENCES {schema}.workflows (id) ON DELETE CASCADE,
    stage       integer NOT NULL,
    is_group    boolean NOT NULL,
    pending     integer NOT NULL,
    PRIMARY KEY (workflow_id, stage)
);

CREATE TABLE {schema}.workflow_steps (
    workflow_id text        NOT NULL REFERENCES {schema}.workflows (id) ON DELETE CASCADE,
    stage       integer     NOT NULL,
    position    integer     NOT NULL,
    message_id  text        NOT NULL,
    actor_name  text        NOT NULL,
    queue_name  text        NOT NULL,
    -- the message as given (encoded), before the previous stage's result is appended
    body        bytea       NOT NULL,
    -- waiting (a later stage), sent, done, dead, cancelled
    state       text        NOT NULL DEFAULT 'waiting',
    result      jsonb,
    -- the W3C traceparent of the run that finished it: the next stage links to it
    traceparent text,
    sent_at     timestamptz,
    finished_at timestamptz,
    PRIMARY KEY (workflow_id, stage, position),
    CONSTRAINT workflow_steps_state CHECK (state IN ('waiting', 'sent', 'done', 'dead', 'cancelled'))
);
-- A step is found by its message id when it finishes (and by 'jobs show'); one message is one
-- step of one workflow.
CREATE UNIQUE INDEX workflow_steps_message ON {schema}.workflow_steps (message_id, workflow_id);

-- Stop a running workflow: it is 'failed' (p_error) and its steps not yet sent never will be;
-- the on_failure message, if any, becomes a row of the outbox or queue table here.
CREATE FUNCTION {schema}.workflow_fail(p_workflow_id text, p_error text, p_target text, p_channel text)
RETURNS boolean LANGUAGE plpgsql SET search_path TO {schema}, pg_catalog AS $$
DECLARE
    w record;
BEGIN
    SELECT * INTO w FROM workflows AS x WHERE x.id = p_workflow_id FOR UPDATE;
    IF NOT FOUND OR w.state <> 'running' THEN
        RETURN false;
    END IF;
    UPDATE workflows AS x SET state = 'failed', error = p_error, finished_at = now() WHERE x.id = p_workflow_id;
    UPDATE workflow_steps AS s SET state = 'cancelled', finished_at = now()
     WHERE s.workflow_id = p_workflow_id AND s.state = 'waiting';
    IF w.failure_body IS NOT NULL THEN
        PERFORM flow_resend(p_target, p_channel, w.failure_message_id, w.failure_queue, w.failure_actor, w.failure_body);
    END IF;
    RETURN true;
END $$;

-- A step finished (p_dead: the worker gave up on it), in its job's transaction.  Returns the
-- status and, for 'advance', the stage whose messages the caller sends now in this transaction:
--   duplicate  counted already (a redelivery), or its workflow is over
--   counted    its stage still has steps running
--   waiting    it died under 'wait': its stage waits for the dead letter's replay
--   advance    it finished its stage: the next stage's steps are marked sent
--   succeeded  it finished the last stage
--   failed     it died (or its result was refused: p_error) and failed the workflow
--   stopped    it finished its stage but the workflow was failed or cancelled meanwhile
CREATE FUNCTION {schema}.workflow_step_finish(
    p_workflow_id text, p_message_id text, p_dead boolean, p_result jsonb, p_error text, p_traceparent text,
    p_target text, p_channel text
) RETURNS TABLE (status text, next_stage integer)
LANGUAGE plpgsql SET search_path TO {schema}, pg_catalog AS $$
DECLARE
    st record;
    w record;
    still integer;
BEGIN
    SELECT * INTO st FROM workflow_steps AS s
     WHERE s.workflow_id = p_workflow_id AND s.message_id = p_message_id FOR UPDATE;
    IF NOT FOUND OR st.state IN ('waiting', 'done', 'cancelled') OR (st.state = 'dead' AND p_dead) THEN
        RETURN QUERY SELECT 'duplicate'::text, NULL::integer;
        RETURN;
    END IF;
    SELECT * INTO w FROM workflows AS x WHERE x.id = p_workflow_id;
    IF st.state = 'dead' AND (w.if_step_dies <> 'wait' OR w.state <> 'running') THEN
        -- A replay of a step that was skipped, or failed its workflow: it ran, nothing more moves.
        UPDATE workflow_steps AS s SET state = 'done', result = p_result, traceparent = p_traceparent, finished_at = now()
         WHERE s.workflow_id = p_workflow_id AND s.stage = st.stage AND s.position = st.position;
        RETURN QUERY SELECT 'duplicate'::text, NULL::integer;
        RETURN;
    END IF;
    UPDATE workflow_steps AS s
       SET state = CASE WHEN p_dead THEN 'dead' ELSE 'done' END,
           result = CASE WHEN p_dead THEN NULL ELSE p_result END,
           traceparent = p_traceparent, finished_at = now()
     WHERE s.workflow_id = p_workflow_id AND s.stage = st.stage AND s.position = st.position;
    IF p_error IS NOT NULL OR (p_dead AND w.if_step_dies = 'fail') THEN
        PERFORM workflow_fail(p_workflow_id, coalesce(p_error, format('step %s (%s) died', p_message_id, st.actor_name)),
                              p_target, p_channel);
        RETURN QUERY SELECT 'failed'::text, NULL::integer;
        RETURN;
    END IF;
    IF p_dead AND w.if_step_dies = 'wait' THEN
        RETURN QUERY SELECT 'waiting'::text, NULL::integer;
        RETURN;
    END IF;
    UPDATE workflow_stages AS g SET pending = g.pending - 1
     WHERE g.workflow_id = p_workflow_id AND g.stage = st.stage
    RETURNING g.pending INTO still;
    IF still > 0 THEN
        RETURN QUERY SELECT 'counted'::text, NULL::integer;
        RETURN;
    END IF;
    -- The stage is complete; the workflow's lock orders this against a cancel.
    SELECT * INTO w FROM workflows AS x WHERE x.id = p_workflow_id FOR UPDATE;
    IF w.state <> 'running' THEN
        RETURN QUERY SELECT 'stopped'::text, NULL::integer;
        RETURN;
    END IF;
    IF st.stage + 1 >= w.stages THEN
        UPDATE workflows AS x SET state = 'succeeded', finished_at = now() WHERE x.id = p_workflow_id;
        RETURN QUERY SELECT 'succeeded'::text, NULL::integer;
        RETURN;
    END IF;
    UPDATE workflows AS x SET stage = st.stage + 1 WHERE x.id = p_workflow_id;
    UPDATE workflow_steps AS s SET state = 'sent', sent_at = now()
     WHERE s.workflow_id = p_workflow_id AND s.stage = st.stage + 1 AND s.state = 'waiting';
    RETURN QUERY SELECT 'advance'::text, st.stage + 1;
END $$;
