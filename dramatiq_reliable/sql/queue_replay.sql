-- One batch of a replay onto Postgres queues (PostgresBroker): as dead_letters_replay.sql, but
-- the messages become queue rows directly (no outbox, no relay), in the same statement that
-- marks the dead letters replayed, so both commit or neither.  A delayed replay waits in
-- available_at; the row's queue is the canonical one.
WITH picked AS (
    SELECT id, last_failed_at
    FROM {schema}.dead_letters
    WHERE state = 'dead'
      AND id <= %(upto_id)s
      AND (%(after_at)s::timestamptz IS NULL
           OR (last_failed_at, id) > (%(after_at)s::timestamptz, %(after_id)s::bigint))
      AND (%(ids)s::bigint[] IS NULL OR id = ANY(%(ids)s::bigint[]))
      AND (%(actor_name)s::text IS NULL OR actor_name = %(actor_name)s::text)
      AND (%(queue_name)s::text IS NULL OR queue_name = %(queue_name)s::text)
      AND (%(error_type)s::text IS NULL OR error_type = %(error_type)s::text)
      AND (%(fingerprint)s::text IS NULL OR fingerprint = %(fingerprint)s::text)
      AND (%(since)s::timestamptz IS NULL OR last_failed_at >= %(since)s::timestamptz)
      AND (%(until)s::timestamptz IS NULL OR last_failed_at < %(until)s::timestamptz)
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
    INSERT INTO {schema}.queue (message_id, queue_name, actor_name, body, priority, available_at)
    SELECT r.message_id,
           r.replayed_to,
           r.actor_name,
           convert_to(
               jsonb_build_object(
                   'queue_name', r.replayed_to || CASE WHEN %(delay_ms)s::bigint IS NULL THEN '' ELSE '.DQ' END,
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
                              ))
                       || CASE WHEN %(delay_ms)s::bigint IS NULL THEN jsonb_build_object()
                               ELSE jsonb_build_object('eta', r.now_ms + %(delay_ms)s::bigint) END,
                   'message_id', r.message_id,
                   -- a fresh timestamp: AgeLimit would otherwise drop the replay on arrival
                   'message_timestamp', r.now_ms
               )::text,
               'UTF8'
           ),
           CASE WHEN jsonb_typeof(r.message -> 'options' -> 'broker_priority') = 'number'
                THEN least(greatest((r.message -> 'options' ->> 'broker_priority')::numeric, 0), 255)::smallint
                ELSE 0
           END,
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
