-- Bound every statement of this transaction (is_local = true: it ends with the transaction, so a
-- pooled connection goes back as it was), so a lock wait or a stalled server cannot hold a nack.
SELECT set_config('statement_timeout', %(timeout_ms)s, true)
