-- Singleton acquires commit without waiting for the WAL flush (synchronous_commit off for their
-- own transaction): a Postgres crash can lose the last few hundred milliseconds of them, while
-- the runs they started go on.  This UNLOGGED one-row table is how the next acquire finds out:
-- Postgres empties unlogged tables after a crash, an immediate shutdown, a failover to a standby
-- or a restore from a base backup, and keeps them over a clean restart (which flushes every
-- commit first).  An acquire that finds the row missing starts a quarantine: no key is handed
-- out for lease_ms (a lost lease would have lapsed by then, and its holder's heartbeat puts it
-- back before that), and the fencing-token sequence jumps far past any token a lost acquire
-- could have handed out.  See dramatiq_reliable/singleton.py.
CREATE UNLOGGED TABLE {schema}.singleton_guard (
    id                integer     PRIMARY KEY CHECK (id = 1),
    -- no key is handed out before this; '-infinity' while no crash has been seen
    quarantine_until  timestamptz NOT NULL
);

INSERT INTO {schema}.singleton_guard (id, quarantine_until) SELECT 1, '-infinity'::timestamptz;
