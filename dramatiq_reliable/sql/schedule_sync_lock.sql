-- Syncs of one schema queue up on this lock (released at commit): concurrent start-ups never
-- interleave their upserts.
SELECT pg_advisory_xact_lock(hashtext(%(key)s))
