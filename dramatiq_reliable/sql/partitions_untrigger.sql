DROP TRIGGER IF EXISTS outbox_move_published ON {schema}.outbox
