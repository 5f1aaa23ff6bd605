-- Dead letters: every message that failed for good, with the error that killed it.
-- A row stays 'dead' until someone replays it (through the outbox) or discards it; handled rows
-- are kept for audit until purged.
CREATE TABLE {schema}.dead_letters (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id      text        NOT NULL,
    -- the canonical queue (never the ".DQ" or ".XQ" name)
    queue_name      text        NOT NULL,
    actor_name      text        NOT NULL,
    -- the whole Dramatiq message as the worker held it in memory when it died: queue_name,
    -- actor_name, args, kwargs, options, message_id, message_timestamp
    message         jsonb       NOT NULL,
    -- module-qualified exception type ("ValueError", "app.errors.PaymentDeclined"); NULL when a
    -- middleware failed the message without an exception
    error_type      text,
    error_message   text        NOT NULL DEFAULT '',
    -- the full traceback of the last attempt, formatted from the exception object
    traceback       text        NOT NULL DEFAULT '',
    -- how many times the actor ran for this message (0: it never ran, e.g. unknown actor)
    attempts        integer     NOT NULL DEFAULT 0,
    -- why it was not retried: retries_exhausted, throws, max_age, actor_not_found, or the
    -- ClassifiedRetries reason (unrecoverable, http_404, ...)
    reason          text        NOT NULL,
    http_status     smallint,
    retry_decision  jsonb,
    -- groups failures from one bug: a hash of error_type and the innermost frame of user code
    fingerprint     text        NOT NULL,
    -- that frame, for people: "app.tasks:42 in send_welcome_email"
    culprit         text,
    -- when the job was first sent (a replayed job keeps its original time): the age that
    -- decides whether a replay is refused as too old
    sent_at         timestamptz NOT NULL,
    first_failed_at timestamptz NOT NULL,
    last_failed_at  timestamptz NOT NULL,
    worker_host     text        NOT NULL,
    worker_pid      integer     NOT NULL,
    -- more than 1 when RabbitMQ redelivered a message that had already died (a worker crashed
    -- between storing the row and the nack): the row is refreshed, never doubled
    captures        integer     NOT NULL DEFAULT 1,
    state           text        NOT NULL DEFAULT 'dead',
    handled_at      timestamptz,
    handled_by      text,
    -- the discard reason, for the audit trail
    note            text,
    -- the queue a replay was sent to
    replayed_to     text,
    CONSTRAINT dead_letters_state CHECK (state IN ('dead', 'replayed', 'discarded')),
    CONSTRAINT dead_letters_handled CHECK ((state = 'dead') = (handled_at IS NULL))
)
-- Keep heap rows small: the message and the traceback (often kilobytes) move to TOAST, so
-- listings read fewer pages and a state change (a non-HOT update) copies a short row.
WITH (toast_tuple_target = 256);

-- A message is dead at most once at a time; a replayed message that dies again gets a new row.
CREATE UNIQUE INDEX dead_letters_dead_message ON {schema}.dead_letters (message_id) WHERE state = 'dead';

-- Listings show dead rows newest first, filtered by one column and paginated on
-- (last_failed_at, id): each filter has an index whose order is the listing's order.  Bulk
-- replays and discards walk the same indexes in the other direction, in keyset batches.
CREATE INDEX dead_letters_dead_recent ON {schema}.dead_letters (last_failed_at DESC, id DESC)
    WHERE state = 'dead';
CREATE INDEX dead_letters_dead_actor ON {schema}.dead_letters (actor_name, last_failed_at DESC, id DESC)
    WHERE state = 'dead';
CREATE INDEX dead_letters_dead_queue ON {schema}.dead_letters (queue_name, last_failed_at DESC, id DESC)
    WHERE state = 'dead';
CREATE INDEX dead_letters_dead_error ON {schema}.dead_letters (error_type, last_failed_at DESC, id DESC)
    WHERE state = 'dead';
CREATE INDEX dead_letters_dead_fingerprint ON {schema}.dead_letters (fingerprint, last_failed_at DESC, id DESC)
    WHERE state = 'dead';
-- Retention purges handled rows by when they were handled.
CREATE INDEX dead_letters_handled ON {schema}.dead_letters (handled_at) WHERE state <> 'dead';
