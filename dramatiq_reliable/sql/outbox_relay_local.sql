-- The relay's own transaction settings; set_config(..., true) is SET LOCAL, so a pooled
-- connection goes back to the pool as it came.
-- enable_sort off makes the claim walk outbox_due in due order and stop after batch_size
-- rows.  With statistics taken while almost every row was published (or none yet,
-- on a new table) the planner expects a handful of unpublished rows and prefers to fetch all
-- of them and sort: under a backlog of N rows every claim then reads and sorts N rows, bodies
-- included, just when the relay has the most to do.  Nothing else in this transaction sorts.
SELECT set_config('statement_timeout', %(statement_timeout)s, true),
       set_config('idle_in_transaction_session_timeout', %(idle_timeout)s, true),
       set_config('enable_sort', 'off', true)
