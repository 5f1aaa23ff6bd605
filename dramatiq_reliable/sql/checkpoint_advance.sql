-- Record a checkpoint's new watermark in the caller's transaction (the row is already locked).
UPDATE {schema}.checkpoints
SET watermark_at = %(watermark_at)s,
    watermark_id = %(watermark_id)s,
    message_id = %(message_id)s,
    updated_at = clock_timestamp()
WHERE name = %(name)s
