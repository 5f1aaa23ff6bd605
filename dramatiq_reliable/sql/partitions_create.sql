-- A partition is made as a plain table and then attached: ATTACH takes only a SHARE UPDATE
-- EXCLUSIVE lock on the parent, so relays marking rows are never blocked (CREATE TABLE ...
-- PARTITION OF would take an ACCESS EXCLUSIVE one).  The table is empty: nothing to validate.
CREATE TABLE IF NOT EXISTS {schema}.{name} (LIKE {schema}.{parent} INCLUDING DEFAULTS INCLUDING CONSTRAINTS);
ALTER TABLE {schema}.{parent} ATTACH PARTITION {schema}.{name} FOR VALUES FROM ({lower}) TO ({upper})
