-- Order per key: a job that is not its key's head is parked when it is sent, not when it is
-- delivered (flow/order.py).
--
-- Before, every ordered job was written to the outbox or the queue, delivered, found not to be
-- its key's head, parked (its body written to order_jobs, the delivery acked) and sent again when
-- its turn came: two deliveries and a park for nearly every job of a busy key.  Now the sender's
-- write of such a job goes to its order_jobs row instead (state 'parked', the body, held_by = the
-- sending transaction), and when that transaction commits a deferred trigger sends the rows that
-- are their key's head: one delivery per job.
--
-- Why at commit, under the key's run lock: a head that finishes while the sender's transaction is
-- open cannot see the sender's row (not committed yet), so its release wakes nobody.  The trigger
-- runs in the sender's commit after taking the same lock the release holds, and reads after it:
-- either the release committed first (the trigger sees the head gone and sends its own row) or the
-- trigger did (the release, reading after the lock, sees the committed parked row and wakes it).
-- Only under READ COMMITTED, where each statement of the trigger reads what committed before it
-- (order_hold.sql parks nothing at send under another isolation: those sends go the old way).

ALTER TABLE {schema}.order_jobs
    -- The sending transaction of a row parked at send, until its commit decided (then NULL).
    ADD COLUMN held_by xid8,
    -- Where that row is sent when it is woken: 'outbox' or 'queue' (the sending broker's table).
    ADD COLUMN send_to text;
CREATE INDEX order_jobs_held_by ON {schema}.order_jobs (held_by) WHERE held_by IS NOT NULL;

-- At the sender's commit: every key this transaction parked a job of is locked, in key order (a
-- batch of releases locks in key order too, so the two never deadlock), and each key's head is
-- sent if it is a job parked here and nothing runs.  The first firing does the whole
-- transaction; later ones find nothing left.
CREATE FUNCTION {schema}.order_held_commit() RETURNS trigger
LANGUAGE plpgsql SET search_path TO {schema}, pg_catalog AS $$
DECLARE
    me xid8 := pg_current_xact_id();
    prefix text := 'dramatiq_reliable.order-run:' || current_schema() || ':';
    keys text[];
    targets text[];
BEGIN
    SELECT array_agg(d.key ORDER BY d.key), array_agg(d.send_to ORDER BY d.key) INTO keys, targets
      FROM (SELECT DISTINCT j.key, j.send_to FROM order_jobs AS j WHERE j.held_by = me) AS d;
    IF keys IS NULL THEN
        RETURN NULL;
    END IF;
    FOR i IN 1 .. array_length(keys, 1) LOOP
        PERFORM pg_advisory_xact_lock(hashtextextended(prefix || keys[i], 0));
    END LOOP;
    UPDATE order_jobs AS j SET held_by = NULL WHERE j.held_by = me;
    -- Each call reads after the locks: a release that committed while this waited is seen.
    FOR i IN 1 .. array_length(keys, 1) LOOP
        PERFORM order_wake(keys[i], targets[i], current_schema() || '.outbox');
    END LOOP;
    RETURN NULL;
END $$;

CREATE CONSTRAINT TRIGGER order_jobs_held
    AFTER INSERT OR UPDATE OF held_by ON {schema}.order_jobs
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW WHEN (NEW.held_by IS NOT NULL)
    EXECUTE FUNCTION {schema}.order_held_commit();
