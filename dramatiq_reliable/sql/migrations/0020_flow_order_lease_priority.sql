-- Order per key at half the writes, and woken jobs that keep their priority (flow/order.py,
-- flow/concurrency.py).
--
-- The running head's lease moves from order_keys onto its own order_jobs row, which the take
-- rewrote anyway (state and body): a take is one row update instead of three (a row lock and an
-- update of the key's row, then the job's row), a release one delete instead of three.  Take,
-- release and sweep of one key are serialised by a transaction advisory lock on the key (nothing
-- written, safe behind PgBouncer in transaction mode) instead of the key row's lock.  order_keys
-- goes: it held a row per key ever used and nothing purged it; a finished key now leaves no row.
--
-- A parked message (order or concurrency) keeps its broker priority and is sent again with it.  A
-- woken ordered job on a PostgresBroker also keeps its place in the queue (its row is visible
-- since it was sent, so it is claimed before messages sent after it): sent to the back, it let
-- the later jobs of its key, already in the queue, reach a worker first, and each parked in turn.

ALTER TABLE {schema}.order_jobs
    ADD COLUMN token      bigint,
    ADD COLUMN owner      text,
    ADD COLUMN expires_at timestamptz,
    ADD COLUMN priority   smallint,
    -- Delivered again while it ran (a retry quicker than the release, a broker's redelivery): if the
    -- run fails, that delivery is sent again by the release (it was acked when it parked).
    ADD COLUMN redelivered boolean NOT NULL DEFAULT false;
-- The sweep's search for lapsed leases (killed workers).
CREATE INDEX order_jobs_expires ON {schema}.order_jobs (expires_at) WHERE state = 'running';

-- Leases held while migrating move onto their job's row.
UPDATE {schema}.order_jobs AS j
   SET token = o.token, owner = o.owner, expires_at = o.expires_at
  FROM {schema}.order_keys AS o
 WHERE o.key = j.key AND o.holder_seq = j.seq AND j.state = 'running';
UPDATE {schema}.order_jobs AS j
   SET expires_at = now()
 WHERE j.state = 'running' AND j.expires_at IS NULL;

ALTER TABLE {schema}.concurrency_parked ADD COLUMN priority smallint;

DROP FUNCTION {schema}.order_take(text, text, bigint, text, bytea, boolean);
DROP FUNCTION {schema}.order_release(text, bigint, bigint, boolean, text, text);
DROP FUNCTION {schema}.order_sweep(int, text, text);
DROP FUNCTION {schema}.concurrency_take(text, text, int, text, text, text, bigint, text, bytea);
DROP INDEX {schema}.order_keys_expires;
DROP TABLE {schema}.order_keys;

-- Send a parked message again with its priority (see 0014); p_since (or now): where it queues.
-- Both new arguments default to NULL (priority 0, queued now), so the six-argument calls of the
-- batch and workflow functions (0015, 0017) resolve to this one.
DROP FUNCTION {schema}.flow_resend(text, text, text, text, text, bytea);
CREATE FUNCTION {schema}.flow_resend(
    p_target text, p_channel text, p_message_id text, p_queue_name text, p_actor_name text, p_body bytea,
    p_priority smallint DEFAULT NULL, p_since timestamptz DEFAULT NULL
) RETURNS void LANGUAGE plpgsql SET search_path TO {schema}, pg_catalog AS $$
BEGIN
    IF p_target = 'queue' THEN
        INSERT INTO queue (queue_name, message_id, actor_name, body, priority, available_at)
        VALUES (p_queue_name, p_message_id, p_actor_name, p_body, coalesce(p_priority, 0),
                least(coalesce(p_since, now()), now()));
    ELSE
        INSERT INTO outbox (message_id, queue_name, actor_name, body, priority)
        VALUES (p_message_id, p_queue_name, p_actor_name, p_body, p_priority);
        PERFORM pg_notify(p_channel, '');
    END IF;
END $$;

-- As in 0014, and a parked message keeps its priority.
CREATE FUNCTION {schema}.concurrency_take(
    p_lock text, p_key text, p_limit int, p_message_id text, p_actor_name text, p_owner text,
    p_lease_ms bigint, p_queue_name text, p_body bytea, p_priority smallint
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
    INSERT INTO concurrency_parked (key, message_id, actor_name, queue_name, body, priority)
    VALUES (p_key, p_message_id, p_actor_name, p_queue_name, p_body, p_priority);
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION {schema}.concurrency_release(
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
    RETURNING p.message_id, p.queue_name, p.actor_name, p.body, p.priority INTO woken;
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    PERFORM flow_resend(p_target, p_channel, woken.message_id, woken.queue_name, woken.actor_name, woken.body,
                        woken.priority, NULL);
    RETURN 1;
END $$;

CREATE OR REPLACE FUNCTION {schema}.concurrency_sweep(p_lock_prefix text, p_limit int, p_target text, p_channel text)
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
            RETURNING p.message_id, p.queue_name, p.actor_name, p.body, p.priority
        LOOP
            PERFORM flow_resend(p_target, p_channel, woken.message_id, woken.queue_name, woken.actor_name,
                                woken.body, woken.priority, NULL);
            total := total + 1;
        END LOOP;
    END LOOP;
    RETURN total;
END $$;

-- At consume time: 'run' (this is its key's head and no live lease holds it: the lease is
-- taken), 'parked' (not its turn: the body waits here; or its head runs elsewhere) or 'unknown'
-- (no row: the job is done, a redelivery of it is a duplicate).  p_lock_prefix || key is the
-- key's lock, which take, release and sweep hold until they commit: "park" and "wake" never
-- interleave, so a job never parks just after the release that should have woken it.  With
-- p_wait false (takes of several jobs in one transaction) a key locked elsewhere is not waited
-- for ('busy' back: take it again alone): a batch that holds locks never waits for another.
CREATE FUNCTION {schema}.order_take(
    p_lock_prefix text, p_message_id text, p_owner text, p_lease_ms bigint, p_queue_name text, p_body bytea,
    p_priority smallint, p_async boolean, p_wait boolean
) RETURNS TABLE (outcome text, key text, seq bigint, token bigint) LANGUAGE plpgsql SET search_path TO {schema}, pg_catalog AS $$
DECLARE
    k text;
    s bigint;
    head bigint;
    head_state text;
    head_until timestamptz;
    t bigint;
BEGIN
    SELECT j.key, j.seq INTO k, s FROM order_jobs AS j WHERE j.message_id = p_message_id;
    IF FOUND THEN
        IF p_wait THEN
            PERFORM pg_advisory_xact_lock(hashtextextended(p_lock_prefix || k, 0));
        ELSIF NOT pg_try_advisory_xact_lock(hashtextextended(p_lock_prefix || k, 0)) THEN
            RETURN QUERY SELECT 'busy'::text, k, s, NULL::bigint;
            RETURN;
        END IF;
        -- Read after the lock: a release that committed while this waited is seen.
        SELECT j.seq, j.state, j.expires_at INTO head, head_state, head_until
          FROM order_jobs AS j WHERE j.key = k ORDER BY j.seq LIMIT 1;
    END IF;
    IF head IS NULL OR head > s THEN
        -- Its row went (done by a concurrent delivery of the same message) before the lock.
        RETURN QUERY SELECT 'unknown'::text, NULL::text, NULL::bigint, NULL::bigint;
        RETURN;
    END IF;
    IF head < s THEN
        UPDATE order_jobs AS j SET state = 'parked', queue_name = p_queue_name, body = p_body, priority = p_priority
         WHERE j.key = k AND j.seq = s;
        RETURN QUERY SELECT 'parked'::text, k, s, NULL::bigint;
        RETURN;
    END IF;
    IF head_state = 'running' AND head_until > now() THEN
        -- Delivered again while it runs: the running delivery keeps the place; this one's body is
        -- kept for the release, which sends it again if the run fails.
        UPDATE order_jobs AS j SET redelivered = true, queue_name = p_queue_name, body = p_body, priority = p_priority
         WHERE j.key = k AND j.seq = s;
        RETURN QUERY SELECT 'parked'::text, k, s, NULL::bigint;
        RETURN;
    END IF;
    -- p_async (PostgresBroker): the ack of this delivery is a later synchronous commit of the same
    -- server, which flushes this one too, so the take need not wait for its own WAL flush.
    IF p_async THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
    -- The running head keeps its body: if its release is lost (a crash, an outage) the lease
    -- lapses and the sweep sends it again instead of leaving the key held for ever.
    UPDATE order_jobs AS j
       SET state = 'running', token = nextval('flow_tokens'), owner = p_owner, redelivered = false,
           expires_at = now() + p_lease_ms * interval '1 millisecond',
           queue_name = p_queue_name, body = p_body, priority = p_priority
     WHERE j.key = k AND j.seq = s
    RETURNING j.token INTO t;
    RETURN QUERY SELECT 'run'::text, k, s, t;
END $$;

-- Free the key after a run.  p_done: the job is finished (ran, or will never run): its row goes
-- and the next job of the key, if it was parked, is sent again in this statement (1 back).
-- Otherwise (a failure: a retry or a dead letter follows) the job stays the head, waiting, and a
-- delivery of it that parked while it ran is sent again; a release whose lease was taken over (it
-- lapsed, the sweep sent the job again) changes nothing.
CREATE FUNCTION {schema}.order_release(
    p_lock_prefix text, p_key text, p_seq bigint, p_token bigint, p_done boolean, p_target text, p_channel text
) RETURNS int LANGUAGE plpgsql SET search_path TO {schema}, pg_catalog AS $$
DECLARE
    again boolean;
BEGIN
    -- A release lost in a Postgres crash lets the lease lapse; the sweep then sends the head again
    -- (its body is kept while it runs): a duplicate run at worst, never a key held for ever.
    PERFORM set_config('synchronous_commit', 'off', true);
    PERFORM pg_advisory_xact_lock(hashtextextended(p_lock_prefix || p_key, 0));
    IF NOT p_done THEN
        SELECT j.redelivered INTO again FROM order_jobs AS j
         WHERE j.key = p_key AND j.seq = p_seq AND j.state = 'running' AND j.token = p_token;
        IF NOT FOUND THEN
            RETURN 0;
        END IF;
        UPDATE order_jobs AS j
           SET state = 'waiting', token = NULL, owner = NULL, expires_at = NULL, redelivered = false,
               queue_name = CASE WHEN again THEN j.queue_name END, body = CASE WHEN again THEN j.body END
         WHERE j.key = p_key AND j.seq = p_seq;
        IF again THEN
            RETURN order_wake(p_key, p_target, p_channel);
        END IF;
        RETURN 0;
    END IF;
    DELETE FROM order_jobs AS j WHERE j.key = p_key AND j.seq = p_seq;
    RETURN order_wake(p_key, p_target, p_channel);
END $$;

-- The head of p_key, if it is not running and its body is here (parked, or freed from a lapsed
-- lease by the sweep): marked waiting and sent again with its priority, queued as of its send
-- (1 back).
CREATE OR REPLACE FUNCTION {schema}.order_wake(p_key text, p_target text, p_channel text)
RETURNS int LANGUAGE plpgsql SET search_path TO {schema}, pg_catalog AS $$
DECLARE
    nxt record;
BEGIN
    SELECT j.seq, j.state, j.message_id, j.actor_name, j.queue_name, j.body, j.priority, j.sent_at INTO nxt
      FROM order_jobs AS j WHERE j.key = p_key ORDER BY j.seq LIMIT 1;
    -- A running head keeps its body for the sweep of a lapsed lease: it is never sent from here.
    IF NOT FOUND OR nxt.body IS NULL OR nxt.state = 'running' THEN
        RETURN 0;
    END IF;
    UPDATE order_jobs AS j SET state = 'waiting', queue_name = NULL, body = NULL
     WHERE j.key = p_key AND j.seq = nxt.seq;
    PERFORM flow_resend(p_target, p_channel, nxt.message_id, nxt.queue_name, nxt.actor_name, nxt.body, nxt.priority,
                        nxt.sent_at);
    RETURN 1;
END $$;

-- Free the keys whose holder stopped renewing its lease (a killed worker), the keys whose dead
-- head was discarded from the dead letters, and the places of cancelled jobs; the heads whose
-- body is here are sent again (how many back).  A key another sweep or a take holds is left to
-- the next sweep (several workers sweep at once; none waits for another).
CREATE FUNCTION {schema}.order_sweep(p_lock_prefix text, p_limit int, p_target text, p_channel text)
RETURNS int LANGUAGE plpgsql SET search_path TO {schema}, pg_catalog AS $$
DECLARE
    k text;
    s bigint;
    total int := 0;
BEGIN
    FOR k, s IN SELECT j.key, j.seq FROM order_jobs AS j
                 WHERE j.state = 'running' AND j.expires_at < now()
                 ORDER BY j.expires_at LIMIT p_limit LOOP
        CONTINUE WHEN NOT pg_try_advisory_xact_lock(hashtextextended(p_lock_prefix || k, 0));
        UPDATE order_jobs AS j SET state = 'waiting', token = NULL, owner = NULL, expires_at = NULL, redelivered = false
         WHERE j.key = k AND j.seq = s AND j.state = 'running' AND j.expires_at < now();
        IF FOUND THEN
            total := total + order_wake(k, p_target, p_channel);
        END IF;
    END LOOP;
    FOR k, s IN SELECT j.key, j.seq FROM order_jobs AS j
                 WHERE j.state = 'dead'
                   AND EXISTS (SELECT 1 FROM dead_letters AS d
                                WHERE d.message_id = j.message_id AND d.state = 'discarded')
                   AND NOT EXISTS (SELECT 1 FROM dead_letters AS d
                                    WHERE d.message_id = j.message_id AND d.state = 'dead')
                 LIMIT p_limit LOOP
        CONTINUE WHEN NOT pg_try_advisory_xact_lock(hashtextextended(p_lock_prefix || k, 0));
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
        CONTINUE WHEN NOT pg_try_advisory_xact_lock(hashtextextended(p_lock_prefix || k, 0));
        DELETE FROM order_jobs AS j WHERE j.key = k AND j.seq = s AND j.state <> 'running';
        IF FOUND THEN
            total := total + order_wake(k, p_target, p_channel);
        END IF;
    END LOOP;
    RETURN total;
END $$;
