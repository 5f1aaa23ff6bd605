-- The stored run of a key that has not expired: read only after a claim found a conflict, or
-- before a record-mode job runs.
SELECT payload_hash, message_id AS first_message_id
FROM {schema}.processed_jobs
WHERE actor_name = %(actor_name)s AND job_key = %(job_key)s AND expires_at > now()
