"""A worker process for the long-job acceptance test: an OutboxBroker worker with ``LongJobs``.

Every run of ``job`` records its start and end (with this process's pid) in ``runs``; with
``STALL=1`` the run never ends, so the test can SIGKILL the worker that holds the job's lease.
The worker's own relay (``WorkerRelay``) publishes the outbox and reaps leases that ran out.
"""

from __future__ import annotations

import os
import time

import dramatiq
import psycopg
from psycopg import sql
from worker_apps import run_until_stdin_closes

from dramatiq_reliable.outbox import LongJobs, OutboxBroker, WorkerRelay

DATABASE_URL, SCHEMA, QUEUE = os.environ["DATABASE_URL"], os.environ["SCHEMA"], os.environ["QUEUE"]
broker = OutboxBroker(url=os.environ["RABBITMQ_URL"], database=DATABASE_URL, schema=SCHEMA, consumer_timeout_ms=3000)
broker.add_middleware(LongJobs(lease_ms=int(os.environ["LEASE_MS"]), heartbeat_ms=500))
broker.add_middleware(WorkerRelay(poll_interval_ms=200))
dramatiq.set_broker(broker)
RUNS = sql.Identifier(SCHEMA, "runs")


@dramatiq.actor(queue_name=QUEUE, actor_name="job", max_retries=0, long_running=True)
def job() -> None:
    with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
        row = conn.execute(sql.SQL("INSERT INTO {} (pid) VALUES (%s) RETURNING id").format(RUNS), (os.getpid(),))
        run_id = row.fetchone()
        assert run_id is not None
        if os.environ.get("STALL") == "1":
            time.sleep(600)
        time.sleep(4)  # the work: longer than the node's 3 s consumer_timeout
        conn.execute(sql.SQL("UPDATE {} SET finished_at = clock_timestamp() WHERE id = %s").format(RUNS), run_id)


if __name__ == "__main__":
    run_until_stdin_closes(broker)
