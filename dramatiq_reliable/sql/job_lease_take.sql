-- Take the lease of a message, or take over one that ran out; nothing is returned while another
-- worker's lease is live (the caller then skips this delivery).
INSERT INTO {schema}.job_leases AS l
    (message_id, queue_name, actor_name, body, priority, owner, token, expires_at)
VALUES (
    %(message_id)s, %(queue_name)s, %(actor_name)s, %(body)s, %(priority)s, %(owner)s, %(token)s,
    now() + make_interval(secs => %(lease_s)s::double precision)
)
ON CONFLICT (message_id) DO UPDATE
SET owner = excluded.owner, token = excluded.token, expires_at = excluded.expires_at,
    started_at = now(), takes = l.takes + 1
WHERE l.expires_at < now()
RETURNING l.token, l.takes
