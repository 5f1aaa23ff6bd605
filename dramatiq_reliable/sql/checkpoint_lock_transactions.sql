-- As checkpoint_lock.sql, for a checkpoint over transaction ids (schema version 7).
-- horizon: every transaction with a lower id has ended (committed or rolled back) as of this
-- statement's snapshot, so every committed row stamped with a lower id is visible to the job's
-- later statements on this connection, and no such row can appear later.  An overlapping run
-- that waited on the row lock reports the horizon of before its wait: lower, never unsafe.
-- txid_snapshot_xmin(txid_current_snapshot()) is pg_snapshot_xmin(pg_current_snapshot()) as a
-- bigint, and exists on every Postgres we support (11 and later).
INSERT INTO {schema}.checkpoints AS c (name, watermark_txid)
VALUES (%(name)s, %(initial_txid)s)
ON CONFLICT (name) DO UPDATE SET name = c.name
RETURNING c.watermark_at, c.watermark_id, c.watermark_txid,
          txid_snapshot_xmin(txid_current_snapshot()) AS horizon
