-- Placeholder: version 8 belongs to the delays slice (h22/delays, 0008_outbox_due.sql), which
-- lands with it.  Migrations run 1..N without gaps, so this branch carries an empty 8 until then;
-- delete this file when merging that slice.
SELECT 1;
