-- Placeholder kept only on branch p28-singleton-scheduler: version 16 belongs to a sibling
-- branch, and the no-gap check needs it to exist for 0019_singleton_guard to load.  Drop at merge.
SELECT 1;
