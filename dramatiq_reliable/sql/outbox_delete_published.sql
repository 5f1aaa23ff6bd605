DELETE FROM {schema}.outbox WHERE id = ANY(%(ids)s)
