-- Cancel: delete the message's queue rows no worker holds (waiting, delayed, a retry's backoff);
-- a dead row (".XQ") is finished, not waiting.  A row being claimed is locked: the delete waits,
-- then finds it leased and leaves it, so the caller writes a tombstone instead.
DELETE FROM {schema}.queue
WHERE message_id = %(message_id)s AND lease IS NULL AND right(queue_name, 3) <> '.XQ'
RETURNING queue_name, actor_name
