-- Long jobs running under a lease (LongJobs), per queue; expired ones wait for a relay to requeue them.
SELECT queue_name,
       count(*) AS running,
       count(*) FILTER (WHERE expires_at < now()) AS expired
FROM {schema}.job_leases
GROUP BY queue_name
