-- Unpublished rows that failed on their own (the poison path included: attempts at the relay's
-- max_attempts), worst first, with their last error: what 'outbox retry' would give a fresh start.
-- Reads the partial index outbox_unpublished, so it stays as small as the backlog.
SELECT id, message_id, queue_name, actor_name, attempts, last_error,
       extract(epoch FROM now() - created_at)::double precision AS age_s,
       available_at
FROM {schema}.outbox
WHERE published_at IS NULL AND (attempts > 0 OR last_error IS NOT NULL)
ORDER BY attempts DESC, id
LIMIT %(limit)s
