"""A worker process for the singleton acceptance tests: a PostgresBroker worker with ``Singleton``.

Every run of the singleton ``job`` records its start and its end (with this process's pid) in
``runs``; with ``STALL=1`` the run never ends, so the test can kill the process holding the key.
With ``TXN=1`` the job runs under transactional ``Idempotency``, so it holds its key as a row
lock of its own transaction.
"""

from __future__ import annotations

import os
import time

import dramatiq
import psycopg
from dramatiq.middleware import Callbacks
from psycopg import sql
from worker_apps import run_until_stdin_closes

from dramatiq_reliable import Idempotency, PostgresBroker, Singleton

DATABASE_URL, SCHEMA, QUEUE = os.environ["DATABASE_URL"], os.environ["SCHEMA"], os.environ["QUEUE"]
broker = PostgresBroker(database=DATABASE_URL, schema=SCHEMA, lease_ms=2000)
singleton = Singleton(lease_ms=int(os.environ["SINGLETON_LEASE_MS"]), retry_delay_ms=50)
if os.environ.get("TXN") == "1":
    broker.add_middleware(singleton, before=Callbacks)
    broker.add_middleware(Idempotency(), before=Callbacks)
else:
    broker.add_middleware(singleton)
dramatiq.set_broker(broker)
RUNS = sql.Identifier(SCHEMA, "runs")


@dramatiq.actor(queue_name=QUEUE, actor_name="job", max_retries=0, singleton=True)
def job(n: int) -> None:
    with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
        row = conn.execute(
            sql.SQL("INSERT INTO {} (n, pid) VALUES (%s, %s) RETURNING id").format(RUNS), (n, os.getpid())
        ).fetchone()
        assert row is not None
        if os.environ.get("STALL") == "1":
            time.sleep(600)
        time.sleep(0.05)  # the work: long enough for the other process to try the key meanwhile
        conn.execute(sql.SQL("UPDATE {} SET finished_at = clock_timestamp() WHERE id = %s").format(RUNS), (row[0],))


if __name__ == "__main__":
    run_until_stdin_closes(broker)
