-- The server's clock now (clock_timestamp, not the transaction's start: now() would be stale).
SELECT clock_timestamp() AS server_now
