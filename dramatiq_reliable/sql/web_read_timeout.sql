-- The web page's bound on one borrow of its read pool behind a transaction pooler: LOCAL, as a
-- setting of the connection would stay on a server process other clients get next; a utility
-- statement, not a query, so the transaction has no snapshot yet and a reader may still set its
-- isolation level (jobs_snapshot.sql).
SET LOCAL statement_timeout = {timeout_ms}
