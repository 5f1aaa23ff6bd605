-- An explicit wake-up of every relay listening on the schema's outbox channel, delivered when
-- the transaction it runs in commits (at once in autocommit).  Never sent on the producer's
-- insert: only by paths that write many rows at once or that an operator runs.
SELECT pg_notify(%(channel)s, '')
