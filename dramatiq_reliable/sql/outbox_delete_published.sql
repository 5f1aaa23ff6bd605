DELETE FROM {schema}.outbox WHERE id = ANY(%s)
