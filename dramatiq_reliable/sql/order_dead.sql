-- The head failed for good (a dead letter): its successors wait until it is replayed or discarded.
-- Its release (written by another thread) may not be in yet: a run of this process's own is marked
-- dead too, and the release that follows finds it no longer running and leaves it so.  A run of
-- another process (its lease lapsed here and the key went on) is left to that process.
UPDATE {schema}.order_jobs
   SET state = 'dead', token = NULL, owner = NULL, expires_at = NULL, redelivered = false, queue_name = NULL,
       body = NULL
 WHERE message_id = %(message_id)s AND (state <> 'running' OR owner = %(owner)s)
