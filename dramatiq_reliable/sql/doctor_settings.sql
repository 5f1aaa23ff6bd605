-- The bounds the server puts on this role's sessions (the URL's options and the role's and
-- database's settings included), read before the doctor sets its own, in milliseconds.
SELECT (SELECT setting::bigint * CASE unit WHEN 's' THEN 1000 WHEN 'min' THEN 60000 ELSE 1 END
        FROM pg_settings WHERE name = 'statement_timeout') AS statement_timeout_ms,
       (SELECT setting::bigint * CASE unit WHEN 's' THEN 1000 WHEN 'min' THEN 60000 ELSE 1 END
        FROM pg_settings WHERE name = 'idle_in_transaction_session_timeout') AS idle_in_transaction_ms,
       pg_backend_pid() AS backend_pid,
       inet_server_port() AS server_port,
       clock_timestamp() AS server_now
