-- The job's place in its key's sequence, written in the sender's transaction (senders of one key wait for each other's commit).
SELECT {schema}.order_send(%(lock)s, %(key)s, %(message_id)s, %(actor_name)s) AS seq
