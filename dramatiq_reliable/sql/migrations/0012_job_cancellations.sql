-- Cancelled jobs (dramatiq-reliable jobs cancel): one row per cancelled message id.
-- A job still waiting in the outbox or the Postgres queue table is deleted there and recorded
-- here in the same transaction; one already beyond reach (published to RabbitMQ, held by a
-- worker, running) is recorded here only, as a tombstone: the Cancellation middleware looks the
-- message id up before the actor runs and skips (acks) it, and a running job sees it through
-- is_cancelled().  The row stays, so 'jobs show' can say who cancelled it and when.
CREATE TABLE {schema}.job_cancellations (
    -- the Dramatiq message id: retries and redeliveries keep it, so one row stops them all
    message_id    text        PRIMARY KEY,
    cancelled_at  timestamptz NOT NULL DEFAULT now(),
    -- who asked: a user name from the CLI or the page, or what the caller passed as by=
    cancelled_by  text        NOT NULL,
    reason        text,
    -- where the job was: 'outbox' or 'queue' (its row was deleted with this insert), or
    -- 'in_flight' (published to RabbitMQ, held by a worker or running: a tombstone)
    found_in      text        NOT NULL,
    -- when a worker honoured the tombstone: 'skipped' a delivery, or a running job 'stopped'
    honoured_at   timestamptz,
    honoured_how  text,
    CONSTRAINT job_cancellations_found_in CHECK (found_in IN ('outbox', 'queue', 'in_flight')),
    CONSTRAINT job_cancellations_honoured CHECK (
        (honoured_how IS NULL) = (honoured_at IS NULL) AND honoured_how IN ('skipped', 'stopped')
    )
);

-- Cancel finds a job by its message id in each table that may hold it: the outbox and the
-- queue table are indexed by migration 10; a finished job is told by its processed-job key.
CREATE INDEX processed_jobs_message_id ON {schema}.processed_jobs (message_id);
