-- A batch's row, in the sender's transaction; a second create of the same id changes nothing.
INSERT INTO {schema}.batches (id, if_child_dies, callback_message_id, callback_actor, callback_queue, callback_body,
                              failure_message_id, failure_actor, failure_queue, failure_body)
VALUES (%(id)s, %(if_child_dies)s, %(callback_message_id)s, %(callback_actor)s, %(callback_queue)s, %(callback_body)s,
        %(failure_message_id)s, %(failure_actor)s, %(failure_queue)s, %(failure_body)s)
ON CONFLICT (id) DO NOTHING
