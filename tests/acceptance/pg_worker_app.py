"""A worker process for the kill -9 test: runs one queue of a PostgresBroker until killed.

Every run of ``job`` records itself (with this process's pid) before doing its work; with
``STALL=1`` the work never ends, so the test can kill the process mid-job.
"""

from __future__ import annotations

import os
import time

import dramatiq
import psycopg
from psycopg import sql
from worker_apps import run_until_stdin_closes

from dramatiq_reliable import PostgresBroker

DATABASE_URL, SCHEMA, QUEUE = os.environ["DATABASE_URL"], os.environ["SCHEMA"], os.environ["QUEUE"]
broker = PostgresBroker(database=DATABASE_URL, schema=SCHEMA, lease_ms=int(os.environ.get("LEASE_MS", "2000")))
dramatiq.set_broker(broker)


@dramatiq.actor(queue_name=QUEUE, actor_name="job", max_retries=0)
def job(n: int) -> None:
    with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
        conn.execute(
            sql.SQL("INSERT INTO {} (n, pid) VALUES (%s, %s)").format(sql.Identifier(SCHEMA, "runs")), (n, os.getpid())
        )
    if os.environ.get("STALL") == "1":
        time.sleep(600)


if __name__ == "__main__":
    run_until_stdin_closes(broker)
