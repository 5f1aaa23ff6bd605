-- Producers' outbox inserts no longer notify: a transaction that ran NOTIFY takes a cluster-wide
-- lock at commit, so the trigger of 0001 serialised every producer's commit with every other's,
-- and any trigger on the insert, even an empty one, cost producers 10-15% of their commits/s.
-- The relays wake themselves instead: after an empty pass they poll with a short, growing,
-- jittered backoff up to poll_interval_ms.  Their LISTEN stays for explicit wake-ups
-- (outbox.wake_relays(), 'outbox retry', dead-letter replays, the scheduler's fires).
DROP TRIGGER IF EXISTS outbox_notify ON {schema}.outbox;
DROP FUNCTION IF EXISTS {schema}.outbox_notify();
