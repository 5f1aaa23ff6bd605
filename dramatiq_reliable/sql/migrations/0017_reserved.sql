-- Placeholder for the migration number given to a sibling branch (p26-partitions: 0016,
-- p27-chains: 0017, p28-pgnotify: 0018, p28-singleton-scheduler: 0019); this branch's own
-- migration is 0020.  Drop this file at merge once that branch's migration has this number.
SELECT 1;
