-- Our schema's indexes as Postgres has them: a failed CREATE INDEX CONCURRENTLY leaves one
-- that exists but is not valid (never used by a query, still paid for by every write).
SELECT index.relname AS name, i.indisvalid AS valid
FROM pg_index AS i
JOIN pg_class AS index ON index.oid = i.indexrelid
JOIN pg_namespace AS n ON n.oid = index.relnamespace
WHERE n.nspname = %(schema)s
