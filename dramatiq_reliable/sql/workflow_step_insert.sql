-- One step: the message as given; the first stage's steps are sent in this transaction.
INSERT INTO {schema}.workflow_steps (workflow_id, stage, position, message_id, actor_name, queue_name, body, state,
                                     sent_at)
VALUES (%(workflow_id)s, %(stage)s, %(position)s, %(message_id)s, %(actor_name)s, %(queue_name)s, %(body)s,
        %(state)s, CASE WHEN %(state)s = 'sent' THEN now() END)
