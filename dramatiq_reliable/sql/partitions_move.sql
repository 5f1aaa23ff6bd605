-- Moves published rows from the outbox to the history, oldest first, in bounded batches: the
-- opt-in migration of an existing install, and rows left behind while no partition held them.
-- Only rows a partition holds (published_at from the oldest partition's lower bound on) move;
-- older ones are past retention and the relay's row purge deletes them.  SKIP LOCKED steps over
-- rows a relay is marking.
WITH picked AS (
    SELECT id FROM {schema}.outbox
    WHERE published_at IS NOT NULL AND published_at >= %(since)s AND published_at < %(until)s
    ORDER BY published_at
    LIMIT %(batch_size)s
    FOR UPDATE SKIP LOCKED
), moved AS (
    DELETE FROM {schema}.outbox AS o USING picked AS p WHERE o.id = p.id
    RETURNING o.id, o.message_id, o.queue_name, o.actor_name, o.body, o.priority, o.eta, o.created_at,
              o.available_at, o.published_at, o.attempts, o.last_error
)
INSERT INTO {schema}.outbox_published (id, message_id, queue_name, actor_name, body, priority, eta, created_at,
                                       available_at, published_at, attempts, last_error)
SELECT * FROM moved
