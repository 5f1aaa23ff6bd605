-- Rate limits per key (the RateLimits middleware): one row per key, shared by every worker.
-- The bucket is a token bucket kept as one timestamp (GCRA, the generic cell rate algorithm):
-- "tat" is when the bucket would be full again.  A take is one INSERT ... ON CONFLICT DO UPDATE,
-- so concurrent workers serialise on the key's row lock and never need a session or a lock
-- held between statements; refilling is arithmetic on statement_timestamp(), no timer runs.
CREATE TABLE {schema}.rate_limit_buckets (
    -- the limiter's name, or "<name>:<suffix>" for a key of its own (one customer, one account)
    key            text             PRIMARY KEY,
    limiter        text             NOT NULL,
    -- the declared limit the last take used: milliseconds between two tokens, and the burst
    interval_ms    double precision NOT NULL,
    burst          integer          NOT NULL,
    -- theoretical arrival time: the next token is free once tat - (burst - 1) * interval <= now.
    -- A job that finds none reserves the next one (tat moves on) and is postponed to it.
    tat            timestamptz      NOT NULL,
    -- the latest take: whether it was granted at once, and the slot it got (now, or the time
    -- of the token it reserved); what RETURNING reports.  Then running counts for status.
    last_granted   boolean          NOT NULL,
    last_slot      timestamptz      NOT NULL,
    granted        bigint           NOT NULL DEFAULT 0,
    postponed      bigint           NOT NULL DEFAULT 0,
    -- learnt from the provider: a 429 (or a 503 with Retry-After) pauses the key for every worker
    -- until paused_until, and slows it to slow_factor of its rate until slowed_until
    paused_until   timestamptz,
    paused_status  integer,
    paused_by      text,
    slowed_until   timestamptz,
    slow_factor    double precision,
    updated_at     timestamptz      NOT NULL DEFAULT now(),
    CONSTRAINT rate_limit_buckets_interval CHECK (interval_ms > 0),
    CONSTRAINT rate_limit_buckets_burst CHECK (burst >= 1),
    CONSTRAINT rate_limit_buckets_slow_factor CHECK (slow_factor IS NULL OR (slow_factor > 0 AND slow_factor <= 1))
);
