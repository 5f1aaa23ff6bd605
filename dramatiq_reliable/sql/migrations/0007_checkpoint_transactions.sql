-- Checkpoints over transaction ids (checkpoint(..., transactions=True)).  A sequence assigns ids
-- at INSERT, not at COMMIT, so an id watermark skips a row whose transaction took an id and
-- committed after a later one.  A transaction id watermark does not: a window ends below the
-- oldest transaction still running, and rows carry the id of the transaction that wrote them.
-- In place and additive: old code keeps writing watermark_at or watermark_id, one of the three.
ALTER TABLE {schema}.checkpoints ADD COLUMN watermark_txid bigint;
ALTER TABLE {schema}.checkpoints DROP CONSTRAINT checkpoints_check;
ALTER TABLE {schema}.checkpoints ADD CONSTRAINT checkpoints_one_watermark
    CHECK (num_nonnulls(watermark_at, watermark_id, watermark_txid) = 1);
