-- What became of a transaction a held test send joined: 'in progress', 'committed', 'aborted'
-- (NULL once it is too old for the commit log to tell).
SELECT pg_xact_status(%(xid)s::xid8) AS status
