-- Every queue the outbox has seen within retention (published rows included): the queues the
-- status command reports on when none are named.  A full scan, so the command uses it, never a scrape.
SELECT DISTINCT queue_name FROM {schema}.outbox
