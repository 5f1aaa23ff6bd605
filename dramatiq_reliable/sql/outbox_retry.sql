-- Gives rows that failed on their own (the poison path included) a fresh start: the relay
-- claims them on its next pass.  last_error is kept until they publish or fail again.
UPDATE {schema}.outbox
SET attempts = 0, available_at = now()
WHERE published_at IS NULL AND attempts > 0
