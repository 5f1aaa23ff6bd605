-- The dead letter a dead job's page links to (the partial unique index on message_id answers it).
SELECT id FROM {schema}.dead_letters WHERE message_id = %(message_id)s AND state = 'dead'
