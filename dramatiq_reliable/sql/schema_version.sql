SELECT max(version) FROM {schema}.migrations
