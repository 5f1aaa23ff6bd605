-- The channel every outbox insert notifies on commit (see the trigger in 0001_outbox.sql).
LISTEN {channel}
