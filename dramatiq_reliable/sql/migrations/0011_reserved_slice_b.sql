-- PLACEHOLDER on branch h23/cancel only: slices A and B own migrations 10 and 11.
-- The coordinator drops this file when merging (the loader refuses a gap before 0012).
SELECT 1;
