-- Keep one message for when the key is released: only into an empty slot of a lease still held.
UPDATE {schema}.singleton_leases
   SET buffered_queue_name = %(queue_name)s,
       buffered_actor_name = %(actor_name)s,
       buffered_message_id = %(message_id)s,
       buffered_body = %(body)s
 WHERE key = %(key)s
   AND expires_at >= now()
   AND (buffered_body IS NULL OR buffered_message_id = %(message_id)s)
RETURNING key
