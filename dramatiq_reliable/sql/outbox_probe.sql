-- Whether a pass would find a row to claim, and if not, how many seconds until the next row
-- falls due: what an idle relay runs between passes, in autocommit on its LISTEN connection.
-- One probe of the index outbox_due (its first entry is the next due row), with the claim's
-- conditions, so rows given up on do not keep a relay busy.  Seconds by the server's clock,
-- so a relay whose clock is off still wakes on time.
SELECT extract(epoch FROM min(available_at) - clock_timestamp())::double precision AS due_in_s
FROM {schema}.outbox
WHERE published_at IS NULL AND attempts < %(max_attempts)s
