-- Messages not yet handed to a worker: unpublished outbox rows and unleased queue-table rows.
(SELECT o.message_id, o.queue_name, o.actor_name, o.attempts, NULL::integer AS max_retries,
        NULL::text AS error_type, coalesce(o.last_error, '') AS error_message, o.created_at AS since,
        o.available_at AS next_due_at
 FROM {schema}.outbox o
 WHERE o.published_at IS NULL
   AND (%(actor)s::text IS NULL OR o.actor_name = %(actor)s)
   AND (%(queue)s::text IS NULL OR o.queue_name = %(queue)s OR o.queue_name = %(queue)s || '.DQ')
 ORDER BY o.id
 LIMIT %(limit)s)
UNION ALL
(SELECT q.message_id, q.queue_name, q.actor_name, q.deliveries AS attempts, NULL::integer,
        NULL::text, '', q.enqueued_at, q.available_at
 FROM {schema}.queue q
 WHERE q.lease IS NULL
   AND (%(actor)s::text IS NULL OR q.actor_name = %(actor)s)
   AND (%(queue)s::text IS NULL OR q.queue_name = %(queue)s)
 ORDER BY q.id
 LIMIT %(limit)s)
