-- Whether anything was ever written to a table of ours (the outbox, the queue table): its id
-- sequence has handed out a value (rows may have been deleted since; the sequence remembers).
-- NULL when the role may not read the sequence.
SELECT CASE WHEN has_sequence_privilege(seq, 'SELECT, USAGE') THEN pg_sequence_last_value(seq) IS NOT NULL END AS used
FROM (SELECT pg_get_serial_sequence(%(table)s, 'id')::regclass AS seq) AS sequence_of_table
