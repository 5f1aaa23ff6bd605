-- Placeholder kept only on branch p27-chains: version 16 belongs to another branch, and the
-- no-gap check needs it to exist for 0017_workflows to load.  Drop this file at merge.
SELECT 1;
