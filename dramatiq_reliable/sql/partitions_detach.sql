-- CONCURRENTLY: readers and writers of the other partitions go on; runs outside a transaction.
ALTER TABLE {schema}.{parent} DETACH PARTITION {schema}.{name} CONCURRENTLY
