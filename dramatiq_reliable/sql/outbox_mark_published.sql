UPDATE {schema}.outbox SET published_at = now() WHERE id = ANY(%(ids)s)
