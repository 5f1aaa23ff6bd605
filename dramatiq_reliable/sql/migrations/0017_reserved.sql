-- Placeholder for the migration number given to a sibling branch (p26-partitions: 0016,
-- p27-chains: 0017); this branch's own migration is 0018.  Drop this file at merge if that
-- branch took no migration, and renumber 0018 down.
SELECT 1;
