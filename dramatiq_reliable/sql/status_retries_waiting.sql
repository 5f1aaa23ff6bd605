-- Delayed rows whose eta is still ahead: the retries (and delayed sends) not yet due.  The body
-- says which are retries (options.retries >= 1); the caller decodes it, since a custom encoder
-- may not write JSON.  A retry waits unpublished in the outbox until due; a delay of an older
-- version went to "x.DQ" at once and counts only while the relay keeps published rows
-- (on_published="mark").
SELECT queue_name, body
FROM {schema}.outbox
WHERE eta > now()
