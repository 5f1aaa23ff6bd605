-- to_regclass returns NULL for a missing table instead of raising, so the caller's
-- transaction stays usable whatever state the schema is in.
SELECT to_regclass(%(table)s) IS NOT NULL AS found
