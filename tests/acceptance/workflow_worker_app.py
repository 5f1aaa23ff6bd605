"""A worker process for the workflow chaos tests: Idempotency, DeadLetters and Workflows on either broker.

Settings in the environment (set by the test): ``DATABASE_URL`` (through the test's proxy when it
cuts Postgres), ``SCHEMA``, ``QUEUE``, ``BROKER`` (``postgres`` or ``outbox``; an outbox worker runs
the relay too, as ``WorkerRelay``), ``RABBITMQ_URL`` for the outbox, and ``CHILD_MS`` / ``STEP_MS``
(how long a child and each single step work, so the test's kills and cuts land while they run).
A single step (``start``, ``join``, ``finish``) logs ``<step> attempt run=R pid=P`` to stderr when
it starts, so the test can kill (or cut) that very run in flight.

Every step writes one row to ``effects`` on the job's connection, so the effect, the idempotency
key, the step's mark and the next stage's messages commit together: a row twice is a step whose
effect committed twice.  The chain is ``start -> Group(child x N) -> join -> finish`` and, for the
replay test, ``start -> fragile -> after`` where ``fragile`` (``max_retries=0``) raises while the
``switches`` row says ``broken``.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import dramatiq
from psycopg import sql
from worker_apps import chaos_broker, run_until_stdin_closes

from dramatiq_reliable import job_connection
from dramatiq_reliable.workflows import Workflows

DATABASE_URL, SCHEMA, QUEUE = os.environ["DATABASE_URL"], os.environ["SCHEMA"], os.environ["QUEUE"]
THREADS = int(os.environ.get("THREADS", "4"))
CHILD_S = int(os.environ.get("CHILD_MS", "0")) / 1000
STEP_S = int(os.environ.get("STEP_MS", "0")) / 1000
broker = chaos_broker(Workflows(), lease_ms=1000)

_EFFECT = sql.SQL("INSERT INTO {} (run, step, n, seen, pid) VALUES (%s, %s, %s, %s, %s)").format(
    sql.Identifier(SCHEMA, "effects")
)
_CHILDREN_SEEN = sql.SQL("SELECT count(DISTINCT n) FROM {} WHERE run = %s AND step = 'child'").format(
    sql.Identifier(SCHEMA, "effects")
)
_BROKEN = sql.SQL("SELECT broken FROM {} WHERE run = %s").format(sql.Identifier(SCHEMA, "switches"))


def _effect(run: int, step: str, n: int = 0, seen: int | None = None) -> None:
    job_connection().execute(_EFFECT, (run, step, n, seen, os.getpid()))


def _attempt(run: int, step: str) -> None:
    """Log this run of ``step`` (committed or not: a killed one is run again), then work a while."""
    print(f"{step} attempt run={run} pid={os.getpid()}", file=sys.stderr, flush=True)
    time.sleep(STEP_S)


@dramatiq.actor(queue_name=QUEUE, actor_name="start")
def start(run: int) -> dict[str, int]:
    _attempt(run, "start")
    _effect(run, "start")
    return {"run": run}


@dramatiq.actor(queue_name=QUEUE, actor_name="child")
def child(run: int, n: int, started: dict[str, int]) -> int:
    time.sleep(CHILD_S)  # work, before any lock is taken: the step's mark comes after the actor returns
    assert started == {"run": run}, f"the first step's result did not reach child {n}: {started!r}"
    _effect(run, "child", n)
    return n


@dramatiq.actor(queue_name=QUEUE, actor_name="join")
def join(run: int, results: list[int]) -> int:
    _attempt(run, "join")
    row = job_connection().execute(_CHILDREN_SEEN, (run,)).fetchone()
    # n: 1 when the children's results came in the group's order; seen: the children's effects visible now.
    _effect(run, "join", int(results == list(range(len(results)))), int(row[0]) if row else None)
    return sum(results)


@dramatiq.actor(queue_name=QUEUE, actor_name="finish")
def finish(run: int, total: int) -> None:
    _attempt(run, "finish")
    _effect(run, "finish", total)


@dramatiq.actor(queue_name=QUEUE, actor_name="fragile", max_retries=0)
def fragile(run: int, previous: Any) -> str:
    row = job_connection().execute(_BROKEN, (run,)).fetchone()
    _effect(run, "fragile")  # rolled back with the job when it raises below
    if row is None or row[0]:
        raise RuntimeError(f"run {run}: the fragile step fails until its switch is fixed")
    return "fixed"


@dramatiq.actor(queue_name=QUEUE, actor_name="after")
def after(run: int, previous: str) -> None:
    _effect(run, "after", int(previous == "fixed"))


if __name__ == "__main__":
    run_until_stdin_closes(broker, threads=THREADS)
