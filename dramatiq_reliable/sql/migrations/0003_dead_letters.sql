-- dead letters: filled in by the dead-letters work
SELECT 1;
