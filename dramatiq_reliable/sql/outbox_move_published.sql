-- The relay's mark once partitions are enabled: confirmed rows leave the outbox for the
-- partitioned history in this one statement (a DELETE and an INSERT, about what the UPDATE of
-- outbox_mark_published writes, where the trigger's way pays for the UPDATE as well).  Only while
-- a partition covers now(): past covered_until the rows are marked in place, as without
-- partitions, and maintenance moves them later; a relay never fails a batch over retention.
WITH covered AS (
    SELECT coalesce((SELECT covered_until > now() FROM {schema}.partitioned_tables
                     WHERE table_name = 'outbox_published'), false) AS moves
), moved AS (
    DELETE FROM {schema}.outbox AS o
    WHERE o.id = ANY(%(ids)s) AND (SELECT moves FROM covered)
    RETURNING o.id, o.message_id, o.queue_name, o.actor_name, o.body, o.priority, o.eta, o.created_at,
              o.available_at, o.attempts, o.last_error
), inserted AS (
    INSERT INTO {schema}.outbox_published (id, message_id, queue_name, actor_name, body, priority, eta, created_at,
                                           available_at, published_at, attempts, last_error)
    SELECT id, message_id, queue_name, actor_name, body, priority, eta, created_at, available_at, now(), attempts,
           last_error
    FROM moved
)
UPDATE {schema}.outbox SET published_at = now()
WHERE id = ANY(%(ids)s) AND NOT (SELECT moves FROM covered)
