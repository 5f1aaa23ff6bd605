SELECT message_id, queue_name, actor_name, owner, started_at, expires_at
FROM {schema}.job_leases
WHERE message_id = %(message_id)s
