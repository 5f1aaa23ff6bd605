-- Schedules (scheduled jobs), their ticks, singleton leases and checkpoints.

-- One row per schedule declared in code; every process that declares schedules syncs them at start-up.
CREATE TABLE {schema}.schedules (
    name                text        PRIMARY KEY,
    actor_name          text        NOT NULL,
    queue_name          text        NOT NULL,
    -- exactly one of cron and interval_ms is set
    cron                text,
    interval_ms         bigint,
    -- IANA time zone the cron expression is read in
    tz                  text        NOT NULL DEFAULT 'UTC',
    args                jsonb       NOT NULL DEFAULT '[]',
    kwargs              jsonb       NOT NULL DEFAULT jsonb_build_object(),
    options             jsonb       NOT NULL DEFAULT jsonb_build_object(),
    -- missed ticks: 'skip', 'once' or 'backfill'; overlap: 'skip', 'buffer' or 'allow'
    missed              text        NOT NULL,
    misfire_grace_ms    bigint      NOT NULL,
    backfill_window_ms  bigint      NOT NULL,
    overlap             text        NOT NULL,
    -- a run that has not finished after this long no longer blocks the next tick
    stale_after_ms      bigint      NOT NULL,
    -- what the fields above hash to: a sync that finds another hash recomputes next_fire_at
    definition_hash     text        NOT NULL,
    -- false once the schedule is no longer declared in code; paused by an operator
    enabled             boolean     NOT NULL DEFAULT true,
    paused              boolean     NOT NULL DEFAULT false,
    next_fire_at        timestamptz,
    -- overlap='buffer': the one tick waiting for the previous run to end
    buffered_fire_at    timestamptz,
    last_fire_at        timestamptz,
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now(),
    CHECK ((cron IS NULL) <> (interval_ms IS NULL))
);

-- The scheduler loops claim due rows in next_fire_at order; paused and removed rows stay out of it.
CREATE INDEX schedules_due ON {schema}.schedules (next_fire_at) WHERE enabled AND NOT paused;
-- Buffered ticks are looked at on every pass until the run they wait for ends.
CREATE INDEX schedules_buffered ON {schema}.schedules (name) WHERE buffered_fire_at IS NOT NULL;

-- One row per tick that fired (or was skipped), with the state of its run.
CREATE TABLE {schema}.schedule_ticks (
    schedule_name  text        NOT NULL,
    fire_at        timestamptz NOT NULL,
    -- derived from schedule and fire time: the same tick always has the same message_id
    message_id     text        NOT NULL,
    -- 'enqueued', 'running', 'retrying', 'succeeded', 'failed' or 'skipped'
    state          text        NOT NULL,
    -- why a tick was skipped ('overlap'), or 'manual' for a triggered run
    reason         text,
    created_at     timestamptz NOT NULL DEFAULT now(),
    started_at     timestamptz,
    finished_at    timestamptz,
    updated_at     timestamptz NOT NULL DEFAULT now(),
    -- the primary key is what makes a tick fire at most once, whoever fires it
    PRIMARY KEY (schedule_name, fire_at)
);

-- Workers record run states by message_id.
CREATE INDEX schedule_ticks_message_id ON {schema}.schedule_ticks (message_id);
-- The overlap check looks for the schedule's unfinished runs.
CREATE INDEX schedule_ticks_unfinished ON {schema}.schedule_ticks (schedule_name)
    WHERE state IN ('enqueued', 'running', 'retrying');

-- Singleton actors: one lease per key while a run holds it.
CREATE SEQUENCE {schema}.singleton_tokens;

CREATE TABLE {schema}.singleton_leases (
    key          text        PRIMARY KEY,
    -- fencing token: grows with every acquisition, so a run that lost its lease can be told apart
    token        bigint      NOT NULL,
    -- the message holding the key, and the process running it
    message_id   text        NOT NULL,
    owner        text        NOT NULL,
    acquired_at  timestamptz NOT NULL DEFAULT now(),
    -- the holder renews the lease; a dead holder's lease lapses here
    expires_at   timestamptz NOT NULL,
    -- when_held='buffer': the one encoded message that runs when the key is released
    buffered_queue_name  text,
    buffered_actor_name  text,
    buffered_message_id  text,
    buffered_body        bytea
);

CREATE INDEX singleton_leases_buffered ON {schema}.singleton_leases (expires_at) WHERE buffered_body IS NOT NULL;

-- Checkpoints: the watermark of the last successful run of an incremental job.
CREATE TABLE {schema}.checkpoints (
    name          text        PRIMARY KEY,
    -- one of the two, by the watermark's type
    watermark_at  timestamptz,
    watermark_id  bigint,
    message_id    text,
    updated_at    timestamptz NOT NULL DEFAULT now(),
    CHECK ((watermark_at IS NULL) <> (watermark_id IS NULL))
);
