-- One migration as 'migrate --sql' prints it: applied only while the schema is below its version,
-- so the whole script can run again and a second run changes nothing.  The lock is migrate()'s,
-- so a script and the command never apply the same migration at once.
DO $apply_{tag}$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext({lock_name}));
    IF COALESCE((SELECT max(version) FROM {schema}.migrations), 0) < {version} THEN
        EXECUTE $migration_{tag}$
{body}
$migration_{tag}$;
        INSERT INTO {schema}.migrations (version, name) VALUES ({version}, {name});
    END IF;
END
$apply_{tag}$;
