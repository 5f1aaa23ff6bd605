-- Bounds the relay's own LISTEN connection (never a pooled one): its probes between passes.
SELECT set_config('statement_timeout', %(statement_timeout)s, false)
