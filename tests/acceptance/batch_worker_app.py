"""A worker process for the batch chaos test: Idempotency, DeadLetters and Batches on either broker.

Settings in the environment (set by the test): ``DATABASE_URL`` (through the test's proxy),
``SCHEMA``, ``QUEUE``, ``BROKER`` (``postgres`` or ``outbox``; an outbox worker runs the relay
too, as ``WorkerRelay``) and ``RABBITMQ_URL`` for the outbox.  ``child(run, n)`` writes its effect row
on the job's connection, so the effect, the idempotency key and the batch's count commit
together; ``report(run)`` writes how many children's effects it can see when it runs.
"""

from __future__ import annotations

import os

import dramatiq
from psycopg import sql
from worker_apps import chaos_broker, run_until_stdin_closes

from dramatiq_reliable import job_connection
from dramatiq_reliable.workflows import Batches

DATABASE_URL, SCHEMA, QUEUE = os.environ["DATABASE_URL"], os.environ["SCHEMA"], os.environ["QUEUE"]
THREADS = int(os.environ.get("THREADS", "4"))
broker = chaos_broker(Batches(), lease_ms=1500)

_EFFECT = sql.SQL("INSERT INTO {} (run, n, pid) VALUES (%s, %s, %s)").format(sql.Identifier(SCHEMA, "effects"))
_REPORT = sql.SQL(
    "INSERT INTO {} (run, children_seen, pid) SELECT %s, count(DISTINCT n), %s FROM {} WHERE run = %s"
).format(sql.Identifier(SCHEMA, "reports"), sql.Identifier(SCHEMA, "effects"))


@dramatiq.actor(queue_name=QUEUE, actor_name="child")
def child(run: int, n: int) -> None:
    job_connection().execute(_EFFECT, (run, n, os.getpid()))


@dramatiq.actor(queue_name=QUEUE, actor_name="report")
def report(run: int) -> None:
    job_connection().execute(_REPORT, (run, os.getpid(), run))


if __name__ == "__main__":
    run_until_stdin_closes(broker, threads=THREADS)
