-- Processed jobs (Idempotency): one row per job key that ran to completion.
-- In transactional mode the key is the first statement of the job's own transaction, so it
-- commits exactly when the job's writes do; in record mode it is inserted after success.
CREATE TABLE {schema}.processed_jobs (
    -- keys are namespaced by actor: the same business key in two actors names two jobs
    actor_name    text        NOT NULL,
    -- the message_id by default, or a business key such as 'invoice-42'
    job_key       text        NOT NULL,
    -- sha256 of the canonical JSON of the arguments: the same key with other arguments is a bug
    payload_hash  bytea       NOT NULL,
    -- the message that claimed the key (shown when a duplicate or a conflict is reported)
    message_id    text        NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    -- past this instant the key no longer dedupes; the purge reclaims the row
    expires_at    timestamptz NOT NULL,
    -- every lookup is by (actor, key): the claim's ON CONFLICT target and the duplicate check
    PRIMARY KEY (actor_name, job_key)
);

-- Retention deletes expired keys in bounded batches, oldest first.
CREATE INDEX processed_jobs_expires_at ON {schema}.processed_jobs (expires_at);
