-- Lapsed leases whose holder died with a message buffered: take them over to hand the message on.
DELETE FROM {schema}.singleton_leases
 WHERE key IN (SELECT key FROM {schema}.singleton_leases
                WHERE buffered_body IS NOT NULL AND expires_at < now()
                ORDER BY expires_at
                LIMIT %(limit)s
                FOR UPDATE SKIP LOCKED)
RETURNING buffered_queue_name, buffered_actor_name, buffered_message_id, buffered_body
