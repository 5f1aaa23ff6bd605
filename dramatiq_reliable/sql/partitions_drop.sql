DROP TABLE IF EXISTS {schema}.{name}
