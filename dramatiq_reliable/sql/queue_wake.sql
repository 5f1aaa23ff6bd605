-- An explicit wake-up of the consumers of one queue (an empty name: of every queue), delivered
-- when the transaction it runs in commits (at once in autocommit).  Never sent on a producer's
-- insert: only by paths that write many rows at once or that an operator runs.
SELECT pg_notify(%(channel)s, %(queue_name)s)
