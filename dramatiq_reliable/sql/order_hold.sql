-- A job that is not sent to the broker: its body waits on its order_jobs row, and the sender's
-- commit sends it if it is its key's head (order_held_commit, migration 22).  No row back (under
-- an isolation other than READ COMMITTED, or a place already used): the broker writes it as usual.
UPDATE {schema}.order_jobs AS j
   SET state = 'parked', queue_name = %(queue_name)s, body = %(body)s, priority = %(priority)s,
       held_by = pg_current_xact_id(), send_to = %(target)s
 WHERE j.message_id = %(message_id)s AND j.state = 'waiting' AND j.body IS NULL AND j.held_by IS NULL
   AND current_setting('transaction_isolation') = 'read committed'
RETURNING j.seq
