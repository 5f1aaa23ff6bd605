-- The message id of one recorded tick (a manual trigger finds the one written in the same millisecond).
SELECT message_id
FROM {schema}.schedule_ticks
WHERE schedule_name = %(name)s AND fire_at = %(fire_at)s
