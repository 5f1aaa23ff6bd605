-- Cancel: delete the message's rows not yet published (waiting, delayed, or a retry's backoff).
-- A row a relay has claimed is locked: the delete waits for its commit, then finds it published
-- and leaves it, so the caller writes a tombstone instead.
DELETE FROM {schema}.outbox
WHERE message_id = %(message_id)s AND published_at IS NULL
RETURNING queue_name, actor_name
