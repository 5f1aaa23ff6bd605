-- Read a checkpoint's watermark and lock its row until the caller's transaction ends.
-- The first run inserts the initial watermark; an overlapping run waits on the row lock here and
-- then reads the watermark the first run committed (READ COMMITTED re-reads the newest version).
-- Timestamp and integer checkpoints (schema version 5 and later); transaction-id checkpoints
-- use checkpoint_lock_transactions.sql.
INSERT INTO {schema}.checkpoints AS c (name, watermark_at, watermark_id)
VALUES (%(name)s, %(initial_at)s, %(initial_id)s)
ON CONFLICT (name) DO UPDATE SET name = c.name
RETURNING c.watermark_at, c.watermark_id, clock_timestamp() - make_interval(secs => %(lag_s)s) AS until
