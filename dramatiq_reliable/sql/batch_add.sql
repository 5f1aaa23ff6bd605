-- One child's membership, in the sender's transaction (a status back, never an error).
SELECT {schema}.batch_add(%(batch_id)s, %(message_id)s) AS status
