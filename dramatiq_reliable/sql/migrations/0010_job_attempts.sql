-- The failure record (ClassifiedRetries): one row per message that failed at least once, upserted
-- on each failed attempt.  A job that never fails writes nothing here, so the happy path pays
-- nothing.  `jobs show` reads it for "retrying: attempt n of max, last error, next try due".
CREATE TABLE {schema}.job_attempts (
    message_id    text        PRIMARY KEY,
    queue_name    text        NOT NULL,
    actor_name    text        NOT NULL,
    -- attempts that ran and failed (the retry middleware's count: options["retries"])
    attempts      integer     NOT NULL,
    -- NULL: no limit
    max_retries   integer,
    -- what ClassifiedRetries decided: retry, fail, exhausted, deadline, outcome_unknown
    outcome       text        NOT NULL,
    -- why, from the classifier (transient, http_404, unrecoverable, ...)
    reason        text        NOT NULL DEFAULT '',
    error_type    text,
    error_message text        NOT NULL DEFAULT '',
    -- the innermost frame of the last error, for people: "app/tasks.py:42 in send_email"
    error_where   text,
    failed_at     timestamptz NOT NULL DEFAULT now(),
    -- when the retry is due (NULL once the middleware gave up)
    next_due_at   timestamptz,
    -- the W3C trace id of the message's creation context, when Tracing put one in its options
    trace_id      text,
    -- past this instant the record is purged with the expired idempotency keys
    expires_at    timestamptz NOT NULL
);

-- `jobs list --state retrying` walks the latest failures first; the purge walks expires_at.
CREATE INDEX job_attempts_failed_at ON {schema}.job_attempts (failed_at DESC);
CREATE INDEX job_attempts_expires_at ON {schema}.job_attempts (expires_at);

-- `jobs show ID` finds a message's rows by id in the outbox and the Postgres queue table.
CREATE INDEX outbox_message_id ON {schema}.outbox (message_id);
CREATE INDEX queue_message_id ON {schema}.queue (message_id);
