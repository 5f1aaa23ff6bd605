-- Pause or resume; a resumed schedule fires from its next tick after now, never the paused ones.
UPDATE {schema}.schedules
SET paused = %(paused)s,
    next_fire_at = COALESCE(%(next_fire_at)s, next_fire_at),
    buffered_fire_at = CASE WHEN %(paused)s THEN NULL ELSE buffered_fire_at END,
    updated_at = now()
WHERE name = %(name)s
