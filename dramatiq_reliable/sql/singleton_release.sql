-- Release the lease this run holds (its token: never a successor's) and return the buffered message.
DELETE FROM {schema}.singleton_leases
 WHERE key = %(key)s AND token = %(token)s
RETURNING buffered_queue_name, buffered_actor_name, buffered_message_id, buffered_body
