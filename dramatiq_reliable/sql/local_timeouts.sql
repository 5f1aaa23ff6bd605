-- set_config(..., true) is SET LOCAL: the bounds end with this transaction, so a pooled
-- connection goes back to the pool as it came.  Only ever run on our own transactions.
SELECT set_config('statement_timeout', %(statement_timeout)s, true),
       set_config('idle_in_transaction_session_timeout', %(idle_timeout)s, true)
