-- One child's state, by its batch and message id (the primary key).
SELECT c.state FROM {schema}.batch_children AS c WHERE c.batch_id = %(batch_id)s AND c.message_id = %(message_id)s
