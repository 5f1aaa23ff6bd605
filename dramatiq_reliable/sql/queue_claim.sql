-- Claim the next visible rows of one queue for one consumer: SKIP LOCKED lets any number of
-- consumers claim at once without waiting on each other, and the lease (available_at moved to
-- the end of the lease, with a fresh token) hides the rows until they are acked or the lease runs out.
WITH picked AS (
    SELECT id, priority, available_at
    FROM {schema}.queue
    WHERE queue_name = %(queue_name)s AND available_at <= now()
    ORDER BY priority DESC, available_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), claimed AS (
    UPDATE {schema}.queue AS q
    SET available_at = now() + make_interval(secs => %(lease_s)s::double precision),
        lease = %(lease)s,
        deliveries = q.deliveries + 1
    FROM picked
    WHERE q.id = picked.id
    RETURNING q.id, q.body, q.deliveries
)
SELECT c.id, c.body, c.deliveries
FROM claimed AS c JOIN picked AS p ON p.id = c.id
ORDER BY p.priority DESC, p.available_at, p.id
