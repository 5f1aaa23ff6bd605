-- The longest-running long job (LongJobs leases): how long jobs of this deployment do run.
SELECT coalesce(extract(epoch FROM now() - min(started_at)) * 1000, 0)::double precision AS longest_lease_ms
FROM {schema}.job_leases
