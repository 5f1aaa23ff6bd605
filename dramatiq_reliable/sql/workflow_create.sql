-- A workflow's row, in the sender's transaction; an id used before is refused by the primary key.
INSERT INTO {schema}.workflows (id, if_step_dies, stages, failure_message_id, failure_actor, failure_queue, failure_body)
VALUES (%(id)s, %(if_step_dies)s, %(stages)s, %(failure_message_id)s, %(failure_actor)s, %(failure_queue)s,
        %(failure_body)s)
ON CONFLICT (id) DO NOTHING
RETURNING id
