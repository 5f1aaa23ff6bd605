-- {version} and {name} are bound as SQL literals, not parameters: 'migrate --sql' prints this
-- script for people and migration tools to run by hand.
INSERT INTO {schema}.migrations (version, name) VALUES ({version}, {name});
