-- One lock per schema: concurrent migrators queue up here instead of racing on CREATE.
SELECT pg_advisory_xact_lock(hashtext(%(lock_name)s))
