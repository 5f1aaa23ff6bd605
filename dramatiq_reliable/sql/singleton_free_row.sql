-- A free row for a key the job-transaction path has never seen, committed on a connection of its
-- own so that the job's transaction only ever locks rows and never inserts one (an uncommitted
-- insert would make other acquirers wait).  Token 0 is below every token handed out.  Losing it
-- in a crash only means writing it again, so the commit does not wait for the WAL flush.
INSERT INTO {schema}.singleton_leases (key, token, message_id, owner, expires_at)
SELECT %(key)s, 0, '', %(owner)s, '-infinity'
WHERE set_config('synchronous_commit', 'off', true) IS NOT NULL
ON CONFLICT (key) DO NOTHING
