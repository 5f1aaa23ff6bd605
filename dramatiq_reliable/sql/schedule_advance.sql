-- Advance each claimed schedule to its next fire time, in the transaction that recorded its ticks.
UPDATE {schema}.schedules s
SET next_fire_at = a.next_fire_at,
    buffered_fire_at = a.buffered_fire_at,
    last_fire_at = COALESCE(a.last_fire_at, s.last_fire_at),
    updated_at = now()
FROM unnest(
    %(names)s::text[], %(next_fire_ats)s::timestamptz[], %(buffered_fire_ats)s::timestamptz[],
    %(last_fire_ats)s::timestamptz[]
) AS a(name, next_fire_at, buffered_fire_at, last_fire_at)
WHERE s.name = a.name
