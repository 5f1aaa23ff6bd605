-- The first acquire after a crash (the unlogged guard row is gone) starts the quarantine: no key
-- is handed out for lease_ms, and the token sequence jumps by token_gap, past every token an
-- acquire lost in the crash could have handed out (Postgres can give those numbers out again).
-- Only the session that puts the row back moves the sequence.  This commit waits for the flush
-- (synchronous_commit on, whatever the server's default): the jump must outlive a second crash.
WITH started AS (
    INSERT INTO {schema}.singleton_guard (id, quarantine_until)
    SELECT 1, now() + %(lease_ms)s * interval '1 millisecond'
    WHERE set_config('synchronous_commit', 'on', true) IS NOT NULL
    ON CONFLICT (id) DO NOTHING
    RETURNING quarantine_until
)
SELECT setval(%(tokens)s::regclass, nextval(%(tokens)s::regclass) + %(token_gap)s) AS token FROM started
