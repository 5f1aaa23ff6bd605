-- Record a transaction-id checkpoint's new watermark in the caller's transaction (the row is locked).
UPDATE {schema}.checkpoints
SET watermark_txid = %(watermark_txid)s,
    message_id = %(message_id)s,
    updated_at = clock_timestamp()
WHERE name = %(name)s
