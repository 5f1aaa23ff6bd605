-- The web page's bound on one borrow of its read pool behind a transaction pooler (is_local =
-- true: a setting of the connection would stay on a server process other clients get next).
SELECT set_config('statement_timeout', %(timeout_ms)s, true)
