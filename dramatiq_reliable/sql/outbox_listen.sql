-- The channel explicit wake-ups notify (outbox_wake.sql); producers' inserts send nothing.
LISTEN {channel}
