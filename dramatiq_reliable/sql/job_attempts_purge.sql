DELETE FROM {schema}.job_attempts
WHERE message_id IN (
    SELECT message_id FROM {schema}.job_attempts
    WHERE expires_at < now()
    ORDER BY expires_at
    LIMIT %(batch_size)s
)
