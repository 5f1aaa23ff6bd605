-- One batch of a replay: mark dead rows replayed and write their messages to the outbox in one
-- statement, so both commit or neither.  Batches walk (last_failed_at, id), oldest first: the
-- order of the listing indexes, so each filter's index serves the keyset as it is.  Only rows still 'dead' are picked, under a row lock
-- (SKIP LOCKED: a concurrent replay or discard holds the others), so no row is replayed twice.
-- The body is the message as Dramatiq's JSON encoder would write it, minus the options that
-- describe the failed run; message_id is kept (one logical job end to end) and
-- options.replay_of links back to this row.
WITH picked AS (
    SELECT id, last_failed_at
    FROM {schema}.dead_letters
    WHERE state = 'dead'
      AND id <= %(upto_id)s
      AND (%(after_at)s::timestamptz IS NULL
           OR (last_failed_at, id) > (%(after_at)s::timestamptz, %(after_id)s::bigint))
      AND (%(ids)s::bigint[] IS NULL OR id = ANY(%(ids)s::bigint[]))
      AND {filter}
      AND (%(max_age_s)s::double precision IS NULL
           OR sent_at >= now() - make_interval(secs => %(max_age_s)s::double precision))
    ORDER BY last_failed_at, id
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
), replayed AS (
    UPDATE {schema}.dead_letters AS d
    SET state = 'replayed',
        handled_at = now(),
        handled_by = %(handled_by)s,
        replayed_to = coalesce(%(to_queue)s::text, d.queue_name)
    -- = ANY(ARRAY(...)): primary-key lookups, never a hash join over the whole table
    WHERE d.id = ANY(ARRAY(SELECT id FROM picked))
    RETURNING d.id, d.message_id, d.actor_name, d.message, d.sent_at, d.replayed_to,
              (extract(epoch FROM now()) * 1000)::bigint AS now_ms
), sent AS (
    -- A delayed replay waits here until due (available_at), addressed to the queue itself and
    -- with no eta in its body, so no worker holds it unacked for its delay.
    INSERT INTO {schema}.outbox (message_id, queue_name, actor_name, body, priority, eta, available_at)
    SELECT r.message_id,
           r.replayed_to,
           r.actor_name,
           convert_to(
               jsonb_build_object(
                   'queue_name', r.replayed_to,
                   'actor_name', r.actor_name,
                   'args', coalesce(r.message -> 'args', '[]'::jsonb),
                   'kwargs', coalesce(r.message -> 'kwargs', jsonb_build_object()),
                   'options',
                       (coalesce(r.message -> 'options', jsonb_build_object()) - %(reset_options)s::text[])
                       || jsonb_build_object(
                              'replay_of', jsonb_build_object(
                                  'dead_letter_id', r.id,
                                  'sent_at_ms', (extract(epoch FROM r.sent_at) * 1000)::bigint,
                                  'replayed_at_ms', r.now_ms,
                                  'count', coalesce((r.message -> 'options' -> 'replay_of' ->> 'count')::int, 0) + 1
                              )),
                   'message_id', r.message_id,
                   -- a fresh timestamp: AgeLimit would otherwise drop the replay on arrival
                   'message_timestamp', r.now_ms
               )::text,
               'UTF8'
           ),
           CASE WHEN jsonb_typeof(r.message -> 'options' -> 'broker_priority') = 'number'
                THEN least(greatest((r.message -> 'options' ->> 'broker_priority')::numeric, 0), 255)::smallint
           END,
           CASE WHEN %(delay_ms)s::bigint IS NULL THEN NULL
                ELSE to_timestamp((r.now_ms + %(delay_ms)s::bigint)::double precision / 1000) END,
           CASE WHEN %(delay_ms)s::bigint IS NULL THEN now()
                ELSE to_timestamp((r.now_ms + %(delay_ms)s::bigint)::double precision / 1000) END
    FROM replayed AS r
    ORDER BY r.id
    RETURNING 1
)
-- How many went out, and where the next batch starts.
SELECT (SELECT count(*) FROM sent) AS handled, last.last_failed_at, last.id AS last_id
FROM (SELECT 1) AS one
LEFT JOIN LATERAL (SELECT last_failed_at, id FROM picked ORDER BY last_failed_at DESC, id DESC LIMIT 1) AS last ON TRUE
