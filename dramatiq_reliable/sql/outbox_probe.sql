-- Whether a pass would find a row to claim: what an idle relay runs between passes, in
-- autocommit on its LISTEN connection.  One probe of the partial index of unpublished rows,
-- with the claim's conditions, so rows backing off or given up on do not keep a relay busy.
SELECT EXISTS (
    SELECT 1
    FROM {schema}.outbox
    WHERE published_at IS NULL AND available_at <= now() AND attempts < %(max_attempts)s
) AS claimable
