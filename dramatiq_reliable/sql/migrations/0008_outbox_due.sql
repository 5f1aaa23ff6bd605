-- Delayed messages wait in the outbox until they are due (a delayed send, a retry's backoff, a
-- replay with --delay): a row's available_at is its due time, and the relay claims due rows in
-- due order.  Without this index a claim walks outbox_unpublished in id order past every row
-- not yet due, so 10,000 delays scheduled for later would make every pass read 10,000 rows.
-- With it a claim and an idle relay's probe read only due rows, and the next due time is the
-- index's first entry.  outbox_unpublished stays for the queries that count the backlog (and
-- for relays of an older version during a rolling deploy, which claim in id order).
CREATE INDEX outbox_due ON {schema}.outbox (available_at, id) WHERE published_at IS NULL;
