-- The buffered message is running now as the holder: it must not be handed on again.
UPDATE {schema}.singleton_leases
   SET buffered_queue_name = NULL, buffered_actor_name = NULL, buffered_message_id = NULL, buffered_body = NULL
 WHERE key = %(key)s AND token = %(token)s
