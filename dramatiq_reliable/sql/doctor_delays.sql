-- The longest delay a worker would hold unacked: rows published before their eta (written by
-- versions before migration 8, or due now with an eta later) wait in a worker's memory until
-- then.  Rows the relay keeps until due (available_at = eta) never wait in RabbitMQ.
SELECT coalesce(extract(epoch FROM max(eta - greatest(available_at, now())))::double precision * 1000, 0)
           AS longest_delay_ms
FROM {schema}.outbox
WHERE published_at IS NULL AND eta > greatest(available_at, now())
