-- Delayed rows whose eta is still ahead: the retries (and delayed sends) not yet due.  The body
-- says which are retries (options.retries >= 1); the caller decodes it, since a custom encoder
-- may not write JSON.  Published rows count too, so this needs the relay's on_published="mark".
SELECT queue_name, body
FROM {schema}.outbox
WHERE right(queue_name, 3) = '.DQ' AND eta > now()
