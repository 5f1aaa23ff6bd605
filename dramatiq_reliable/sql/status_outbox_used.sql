-- Whether anything was ever written to the outbox: its id sequence has handed out a value
-- (published rows may be deleted; the sequence remembers them).  The sign that this schema's
-- deployment sends through RabbitMQ.  NULL when the role may not read the sequence.
SELECT CASE WHEN has_sequence_privilege(seq, 'SELECT, USAGE') THEN pg_sequence_last_value(seq) IS NOT NULL END AS used
FROM (SELECT pg_get_serial_sequence(%(table)s, 'id')::regclass AS seq) AS sequence_of_outbox
