-- Leases of long jobs (OutboxBroker actors with long_running): a worker writes the message here
-- and acks its RabbitMQ delivery at once, so RabbitMQ's consumer_timeout never closes a channel
-- under a long job.  While the job runs its worker extends expires_at; the job's end deletes the
-- row (in the job's transaction under transactional Idempotency).  A row whose lease ran out
-- (its worker died) is moved back to the outbox by a relay, so the job runs again, never lost.
CREATE TABLE {schema}.job_leases (
    -- one lease per message: a second delivery of a message whose lease is live is skipped
    message_id    text        PRIMARY KEY,
    queue_name    text        NOT NULL,
    actor_name    text        NOT NULL,
    -- the encoded message as delivered, republished as it was if the lease runs out
    body          bytea       NOT NULL,
    priority      smallint,
    -- who runs it: host, pid and a random id of the worker process, for people reading status
    owner         text        NOT NULL,
    -- a random token per take: a heartbeat or release that does not carry it changes nothing
    token         bigint      NOT NULL,
    started_at    timestamptz NOT NULL DEFAULT now(),
    expires_at    timestamptz NOT NULL,
    -- how many times the message was leased (more than 1: it ran again after a lost lease)
    takes         integer     NOT NULL DEFAULT 1
);

-- The reaper looks for leases that ran out.
CREATE INDEX job_leases_expires_at ON {schema}.job_leases (expires_at);
