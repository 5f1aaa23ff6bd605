-- The leased (running) long jobs, oldest first; expired ones are waiting for a relay to reap them.
SELECT message_id, queue_name, actor_name, owner, takes, started_at,
       extract(epoch FROM now() - started_at)::double precision AS running_s,
       expires_at < now() AS expired
FROM {schema}.job_leases
ORDER BY started_at
LIMIT %(limit)s
