-- The head failed for good (a dead letter): its successors wait until it is replayed or discarded.
UPDATE {schema}.order_jobs SET state = 'dead' WHERE message_id = %(message_id)s AND state <> 'running'
