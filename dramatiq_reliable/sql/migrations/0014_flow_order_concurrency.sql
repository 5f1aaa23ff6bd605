-- Concurrency per key and order per key (flow/concurrency.py, flow/order.py).
-- Each decision (take a slot or park, run the head or park, release and wake the next) is one
-- function call: one round trip, and the lock it takes makes "park" and "wake" exclusive, so a
-- message never parks just after the release that should have woken it.

CREATE SEQUENCE {schema}.flow_tokens;

-- One row per running job of a key with a concurrency limit; a dead worker's rows lapse.
CREATE TABLE {schema}.concurrency_slots (
    key          text        NOT NULL,
    -- fencing token, also the slot's identity: a run releases its own slot, never a successor's
    token        bigint      NOT NULL,
    message_id   text        NOT NULL,
    owner        text        NOT NULL,
    acquired_at  timestamptz NOT NULL DEFAULT now(),
    expires_at   timestamptz NOT NULL,
    PRIMARY KEY (key, token)
);
CREATE INDEX concurrency_slots_expires ON {schema}.concurrency_slots (expires_at);

-- Messages that found their key full: out of the broker's queue, woken oldest first per key.
CREATE TABLE {schema}.concurrency_parked (
    id           bigserial   PRIMARY KEY,
    key          text        NOT NULL,
    message_id   text        NOT NULL,
    actor_name   text        NOT NULL,
    queue_name   text        NOT NULL,
    body         bytea       NOT NULL,
    parked_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX concurrency_parked_key ON {schema}.concurrency_parked (key, id);

-- Send a parked message again, as a row of the table the broker sends to: 'queue'
-- (PostgresBroker; its insert trigger wakes the consumers) or 'outbox' (OutboxBroker; the relays
-- are woken on p_channel).  A resend in SQL, as a replay of dead letters is: the message was sent
-- once through the send path already, and this keeps the release one statement.
CREATE FUNCTION {schema}.flow_resend(
    p_target text, p_channel text, p_message_id text, p_queue_name text, p_actor_name text, p_body bytea
) RETURNS void LANGUAGE plpgsql SET search_path TO {schema}, pg_catalog AS $$
BEGIN
    IF p_target = 'queue' THEN
        INSERT INTO queue (queue_name, message_id, actor_name, body) VALUES (p_queue_name, p_message_id, p_actor_name, p_body);
    ELSE
        INSERT INTO outbox (message_id, queue_name, actor_name, body) VALUES (p_message_id, p_queue_name, p_actor_name, p_body);
        PERFORM pg_notify(p_channel, '');
    END IF;
END $$;

-- Take a slot of p_key (the token back) or park the message (NULL back).  The advisory lock is
-- per key and per transaction, so it is safe behind PgBouncer in transaction mode.
CREATE FUNCTION {schema}.concurrency_take(
    p_lock text, p_key text, p_limit int, p_message_id text, p_actor_name text, p_owner text,
    p_lease_ms bigint, p_queue_name text, p_body bytea
) RETURNS bigint LANGUAGE plpgsql SET search_path TO {schema}, pg_catalog AS $$
DECLARE
    live int;
    taken bigint;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended(p_lock, 0));
    SELECT count(*) INTO live FROM concurrency_slots
     WHERE key = p_key AND expires_at > now();
    IF live < p_limit THEN
        -- A slot lost in a Postgres crash only lets one more run in: no WAL flush waited for.
        -- A park is flushed: the message is acked once it returns.
        PERFORM set_config('synchronous_commit', 'off', true);
        INSERT INTO concurrency_slots (key, token, message_id, owner, expires_at)
        VALUES (p_key, nextval('flow_tokens'), p_message_id, p_owner,
                now() + p_lease_ms * interval '1 millisecond')
        RETURNING token INTO taken;
        RETURN taken;
    END IF;
    INSERT INTO concurrency_parked (key, message_id, actor_name, queue_name, body)
    VALUES (p_key, p_message_id, p_actor_name, p_queue_name, p_body);
    RETURN NULL;
END $$;

-- Free the slot of a run and hand its place to the oldest parked message of the key, sent again
-- in this same statement; returns how many were woken.  A slot already lapsed and swept was
-- handed on by the sweep: nothing is woken twice.
CREATE FUNCTION {schema}.concurrency_release(
    p_lock text, p_key text, p_token bigint, p_target text, p_channel text
) RETURNS int LANGUAGE plpgsql SET search_path TO {schema}, pg_catalog AS $$
DECLARE
    woken record;
BEGIN
    -- A release lost in a Postgres crash leaves the slot to lapse, and the sweep hands it on.
    PERFORM set_config('synchronous_commit', 'off', true);
    PERFORM pg_advisory_xact_lock(hashtextextended(p_lock, 0));
    DELETE FROM concurrency_slots AS s WHERE s.key = p_key AND s.token = p_token;
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    DELETE FROM concurrency_parked AS p
     WHERE p.id = (SELECT q.id FROM concurrency_parked AS q WHERE q.key = p_key ORDER BY q.id LIMIT 1)
    RETURNING p.message_id, p.queue_name, p.actor_name, p.body INTO woken;
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    PERFORM flow_resend(p_target, p_channel, woken.message_id, woken.queue_name, woken.actor_name, woken.body);
    RETURN 1;
END $$;

-- Hand the places of lapsed slots (killed workers) to parked messages, one each, sent again here;
-- returns how many.  p_lock_prefix || key is the lock concurrency_take uses.
CREATE FUNCTION {schema}.concurrency_sweep(p_lock_prefix text, p_limit int, p_target text, p_channel text)
RETURNS int LANGUAGE plpgsql SET search_path TO {schema}, pg_catalog AS $$
DECLARE
    k text;
    freed int;
    woken record;
    total int := 0;
BEGIN
    FOR k IN SELECT DISTINCT s.key FROM concurrency_slots AS s WHERE s.expires_at < now() LIMIT p_limit LOOP
        PERFORM pg_advisory_xact_lock(hashtextextended(p_lock_prefix || k, 0));
        DELETE FROM concurrency_slots AS s WHERE s.key = k AND s.expires_at < now();
        GET DIAGNOSTICS freed = ROW_COUNT;
        FOR woken IN
            DELETE FROM concurrency_parked AS p
             WHERE p.id IN (SELECT q.id FROM concurrency_parked AS q WHERE q.key = k ORDER BY q.id LIMIT freed)
            RETURNING p.message_id, p.queue_name, p.actor_name, p.body
        LOOP
            PERFORM flow_resend(p_target, p_channel, woken.message_id, woken.queue_name, woken.actor_name, woken.body);
            total := total + 1;
        END LOOP;
    END LOOP;
    RETURN total;
END $$;

-- Per key sequences of ordered jobs: one row per job sent and not yet done; the head of a key is
-- its lowest seq.  Senders of one key are serialised by an advisory lock until they commit, so
-- seq order is commit order.
CREATE SEQUENCE {schema}.order_seq;

CREATE TABLE {schema}.order_jobs (
    key          text        NOT NULL,
    seq          bigint      NOT NULL,
    message_id   text        NOT NULL UNIQUE,
    actor_name   text        NOT NULL,
    -- waiting (sent, or between attempts), parked (delivered before its turn; body kept here),
    -- running, dead (failed for good: its successors wait until it is replayed or discarded)
    state        text        NOT NULL DEFAULT 'waiting',
    sent_at      timestamptz NOT NULL DEFAULT now(),
    queue_name   text,
    body         bytea,
    PRIMARY KEY (key, seq),
    CONSTRAINT order_jobs_state CHECK (state IN ('waiting', 'parked', 'running', 'dead'))
);
CREATE INDEX order_jobs_state ON {schema}.order_jobs (state) WHERE state IN ('parked', 'dead');

-- The lease of each key's running head: a dead worker's lapses and the sweep frees the key.
CREATE TABLE {schema}.order_keys (
    key          text        PRIMARY KEY,
    holder_seq   bigint,
    token        bigint,
    owner        text,
    expires_at   timestamptz
);
CREATE INDEX order_keys_expires ON {schema}.order_keys (expires_at) WHERE holder_seq IS NOT NULL;

CREATE FUNCTION {schema}.order_send(p_lock text, p_key text, p_message_id text, p_actor_name text)
RETURNS bigint LANGUAGE plpgsql SET search_path TO {schema}, pg_catalog AS $$
DECLARE
    given bigint;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended(p_lock, 0));
    INSERT INTO order_jobs (key, seq, message_id, actor_name)
    VALUES (p_key, nextval('order_seq'), p_message_id, p_actor_name)
    ON CONFLICT (message_id) DO NOTHING
    RETURNING seq INTO given;
    IF given IS NULL THEN
        SELECT j.seq INTO given FROM order_jobs AS j WHERE j.message_id = p_message_id;
    END IF;
    RETURN given;
END $$;

-- At consume time: 'run' (this is its key's head and nobody runs it: the lease is taken),
-- 'parked' (not its turn, or its head runs elsewhere: the body waits here) or 'unknown' (no row:
-- the job is done, a redelivery of it is a duplicate).
CREATE FUNCTION {schema}.order_take(
    p_message_id text, p_owner text, p_lease_ms bigint, p_queue_name text, p_body bytea, p_async boolean
) RETURNS TABLE (outcome text, key text, seq bigint, token bigint) LANGUAGE plpgsql SET search_path TO {schema}, pg_catalog AS $$
DECLARE
    k text;
    s bigint;
    head bigint;
    held_seq bigint;
    held_until timestamptz;
    t bigint;
BEGIN
    SELECT j.key, j.seq INTO k, s FROM order_jobs AS j WHERE j.message_id = p_message_id;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'unknown'::text, NULL::text, NULL::bigint, NULL::bigint;
        RETURN;
    END IF;
    -- The key's row is its lock (take and release of one key never interleave); a row lock
    -- writes no new row version, the insert only happens on a key's first take.
    SELECT o.holder_seq, o.expires_at INTO held_seq, held_until FROM order_keys AS o WHERE o.key = k FOR UPDATE;
    IF NOT FOUND THEN
        INSERT INTO order_keys AS o (key) VALUES (k)
        ON CONFLICT ON CONSTRAINT order_keys_pkey DO UPDATE SET key = o.key
        RETURNING o.holder_seq, o.expires_at INTO held_seq, held_until;
    END IF;
    SELECT min(j.seq) INTO head FROM order_jobs AS j WHERE j.key = k;
    IF s <> head OR (held_seq IS NOT NULL AND held_until > now()) THEN
        UPDATE order_jobs AS j
           SET state = CASE WHEN s <> head THEN 'parked' ELSE j.state END,
               queue_name = p_queue_name, body = p_body
         WHERE j.key = k AND j.seq = s;
        RETURN QUERY SELECT 'parked'::text, k, s, NULL::bigint;
        RETURN;
    END IF;
    -- p_async (PostgresBroker): the ack of this delivery is a later synchronous commit of the same
    -- server, which flushes this one too, so the take need not wait for its own WAL flush.
    IF p_async THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
    UPDATE order_keys AS o
       SET holder_seq = s, token = nextval('flow_tokens'), owner = p_owner,
           expires_at = now() + p_lease_ms * interval '1 millisecond'
     WHERE o.key = k
    RETURNING o.token INTO t;
    -- The running head keeps its body: if its release is lost (a crash, an outage) the lease
    -- lapses and the sweep sends it again instead of leaving the key held for ever.
    UPDATE order_jobs AS j SET state = 'running', queue_name = p_queue_name, body = p_body
     WHERE j.key = k AND j.seq = s;
    RETURN QUERY SELECT 'run'::text, k, s, t;
END $$;

-- Free the key after a run.  p_done: the job is finished (ran, or will never run): its row goes
-- and the next job of the key, if it was parked, is sent again in this statement (1 back).
-- Otherwise (a failure: a retry or a dead letter follows) the job stays the head.
CREATE FUNCTION {schema}.order_release(
    p_key text, p_seq bigint, p_token bigint, p_done boolean, p_target text, p_channel text
) RETURNS int LANGUAGE plpgsql SET search_path TO {schema}, pg_catalog AS $$
BEGIN
    -- A release lost in a Postgres crash lets the lease lapse; the sweep then sends the head again
    -- (its body is kept while it runs): a duplicate run at worst, never a key held for ever.
    PERFORM set_config('synchronous_commit', 'off', true);
    PERFORM 1 FROM order_keys AS o WHERE o.key = p_key FOR UPDATE;
    UPDATE order_keys AS o SET holder_seq = NULL, token = NULL, owner = NULL, expires_at = NULL
     WHERE o.key = p_key AND o.token = p_token;
    IF NOT p_done THEN
        UPDATE order_jobs AS j SET state = 'waiting', queue_name = NULL, body = NULL
         WHERE j.key = p_key AND j.seq = p_seq AND j.state = 'running';
        RETURN 0;
    END IF;
    DELETE FROM order_jobs AS j WHERE j.key = p_key AND j.seq = p_seq;
    RETURN order_wake(p_key, p_target, p_channel);
END $$;

-- The head of p_key, if it is not running and its body is here (parked, or freed from a lapsed
-- lease by the sweep): marked waiting and sent again (1 back).
CREATE FUNCTION {schema}.order_wake(p_key text, p_target text, p_channel text)
RETURNS int LANGUAGE plpgsql SET search_path TO {schema}, pg_catalog AS $$
DECLARE
    nxt record;
BEGIN
    SELECT j.seq, j.state, j.message_id, j.actor_name, j.queue_name, j.body INTO nxt
      FROM order_jobs AS j WHERE j.key = p_key ORDER BY j.seq LIMIT 1;
    -- A running head keeps its body for the sweep of a lapsed lease: it is never sent from here.
    IF NOT FOUND OR nxt.body IS NULL OR nxt.state = 'running' THEN
        RETURN 0;
    END IF;
    UPDATE order_jobs AS j SET state = 'waiting', queue_name = NULL, body = NULL
     WHERE j.key = p_key AND j.seq = nxt.seq;
    PERFORM flow_resend(p_target, p_channel, nxt.message_id, nxt.queue_name, nxt.actor_name, nxt.body);
    RETURN 1;
END $$;

-- Free the keys whose holder stopped renewing its lease (a killed worker), the keys whose dead
-- head was discarded from the dead letters, and the places of cancelled jobs; the heads whose
-- body is here are sent again (how many back).
CREATE FUNCTION {schema}.order_sweep(p_limit int, p_target text, p_channel text)
RETURNS int LANGUAGE plpgsql SET search_path TO {schema}, pg_catalog AS $$
DECLARE
    k text;
    s bigint;
    total int := 0;
BEGIN
    FOR k IN SELECT o.key FROM order_keys AS o
              WHERE o.holder_seq IS NOT NULL AND o.expires_at < now()
              ORDER BY o.expires_at LIMIT p_limit FOR UPDATE SKIP LOCKED LOOP
        UPDATE order_keys AS o SET holder_seq = NULL, token = NULL, owner = NULL, expires_at = NULL WHERE o.key = k;
        UPDATE order_jobs AS j SET state = 'waiting' WHERE j.key = k AND j.state = 'running';
        total := total + order_wake(k, p_target, p_channel);
    END LOOP;
    FOR k, s IN SELECT j.key, j.seq FROM order_jobs AS j
                 WHERE j.state = 'dead'
                   AND EXISTS (SELECT 1 FROM dead_letters AS d
                                WHERE d.message_id = j.message_id AND d.state = 'discarded')
                   AND NOT EXISTS (SELECT 1 FROM dead_letters AS d
                                    WHERE d.message_id = j.message_id AND d.state = 'dead')
                 LIMIT p_limit LOOP
        PERFORM 1 FROM order_keys AS o WHERE o.key = k FOR UPDATE;
        DELETE FROM order_jobs AS j WHERE j.key = k AND j.seq = s AND j.state = 'dead';
        IF FOUND THEN
            total := total + order_wake(k, p_target, p_channel);
        END IF;
    END LOOP;
    -- Cancelled jobs ('jobs cancel' deletes a waiting one's message, so it never comes to take or
    -- free its place): their places go, and a key whose head went is handed on.
    FOR k, s IN SELECT j.key, j.seq FROM order_jobs AS j
                  JOIN job_cancellations AS c ON c.message_id = j.message_id
                 WHERE j.state <> 'running'
                 LIMIT p_limit LOOP
        PERFORM 1 FROM order_keys AS o WHERE o.key = k FOR UPDATE;
        DELETE FROM order_jobs AS j WHERE j.key = k AND j.seq = s AND j.state <> 'running';
        IF FOUND THEN
            total := total + order_wake(k, p_target, p_channel);
        END IF;
    END LOOP;
    RETURN total;
END $$;
