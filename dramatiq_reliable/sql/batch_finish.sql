-- A child done or dead, in its job's transaction; the last one sends the callback here.
SELECT {schema}.batch_finish(%(batch_id)s, %(message_id)s, %(dead)s, %(target)s, %(channel)s) AS status
