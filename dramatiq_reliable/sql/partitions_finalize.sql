ALTER TABLE {schema}.{parent} DETACH PARTITION {schema}.{name} FINALIZE
