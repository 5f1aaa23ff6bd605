-- A schedule whose ticks written ahead were retracted (its timing unchanged) fires them again:
-- next_fire_at goes back to the earliest retracted fire time, in the same transaction.
UPDATE {schema}.schedules
SET next_fire_at = LEAST(next_fire_at, %(first_fire_at)s), updated_at = now()
WHERE name = %(name)s
