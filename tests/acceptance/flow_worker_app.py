"""A worker process for the flow acceptance tests: a worker with ConcurrencyLimit and OrderedKeys.

A ``PostgresBroker`` worker, or with ``BROKER=outbox`` an ``OutboxBroker`` one with its ``WorkerRelay``.

Every run records its actor, key, number, pid, start and end in ``runs``.  ``limited`` has
``concurrency_limit=LIMIT`` per tenant; with ``STALL=1`` its job 0 never ends, so the test can
kill the process holding a slot.  ``ordered`` has an ``order_key``; a run fails while its
``(key, n)`` row in ``plan`` has failures left (the test sets them), and dead jobs are
dead-lettered.
"""

from __future__ import annotations

import os
import time

import dramatiq
import psycopg
from dramatiq.middleware import Callbacks
from psycopg import sql
from worker_apps import run_until_stdin_closes

from dramatiq_reliable import DeadLetters, OutboxBroker, PostgresBroker, WorkerRelay
from dramatiq_reliable.flow import ConcurrencyLimit, OrderedKeys

DATABASE_URL, SCHEMA, QUEUE = os.environ["DATABASE_URL"], os.environ["SCHEMA"], os.environ["QUEUE"]
LEASE_MS = int(os.environ.get("FLOW_LEASE_MS", "1500"))
WORK_S = int(os.environ.get("WORK_MS", "20")) / 1000
broker: PostgresBroker | OutboxBroker
if os.environ.get("BROKER", "postgres") == "postgres":
    broker = PostgresBroker(database=DATABASE_URL, schema=SCHEMA, lease_ms=LEASE_MS)
else:
    broker = OutboxBroker(url=os.environ["RABBITMQ_URL"], database=DATABASE_URL, schema=SCHEMA)
    broker.add_middleware(WorkerRelay(poll_interval_ms=50))
broker.add_middleware(ConcurrencyLimit(lease_ms=LEASE_MS), before=Callbacks)
broker.add_middleware(OrderedKeys(lease_ms=LEASE_MS), before=Callbacks)
broker.add_middleware(DeadLetters())
dramatiq.set_broker(broker)
RUNS, PLAN = sql.Identifier(SCHEMA, "runs"), sql.Identifier(SCHEMA, "plan")


def _record(actor: str, key: str, n: int) -> tuple[psycopg.Connection[tuple[object, ...]], object]:
    conn = psycopg.connect(DATABASE_URL, autocommit=True)
    row = conn.execute(
        sql.SQL("INSERT INTO {} (actor, key, n, pid) VALUES (%s, %s, %s, %s) RETURNING id").format(RUNS),
        (actor, key, n, os.getpid()),
    ).fetchone()
    assert row is not None
    return conn, row[0]


def _finish(conn: psycopg.Connection[tuple[object, ...]], run_id: object, outcome: str) -> None:
    conn.execute(
        sql.SQL("UPDATE {} SET finished_at = clock_timestamp(), outcome = %s WHERE id = %s").format(RUNS),
        (outcome, run_id),
    )
    conn.close()


@dramatiq.actor(
    queue_name=QUEUE,
    actor_name="limited",
    max_retries=0,
    concurrency_limit=int(os.environ.get("LIMIT", "1")),
    concurrency_limit_key=lambda tenant, n: tenant,
)
def limited(tenant: str, n: int) -> None:
    conn, run_id = _record("limited", tenant, n)
    if n == 0 and os.environ.get("STALL") == "1":
        time.sleep(600)
    time.sleep(WORK_S)
    _finish(conn, run_id, "ok")


@dramatiq.actor(
    queue_name=QUEUE, actor_name="ordered", max_retries=1, min_backoff=50, max_backoff=100, order_key=lambda key, n: key
)
def ordered(key: str, n: int) -> None:
    conn, run_id = _record("ordered", key, n)
    time.sleep(WORK_S)
    failing = conn.execute(
        sql.SQL("UPDATE {} SET fails = fails - 1 WHERE key = %s AND n = %s AND fails > 0 RETURNING fails").format(PLAN),
        (key, n),
    ).fetchone()
    _finish(conn, run_id, "failed" if failing else "ok")
    if failing:
        raise RuntimeError(f"ordered {key}{n} failed as planned")


if __name__ == "__main__":
    run_until_stdin_closes(broker, threads=int(os.environ.get("THREADS", "4")))
