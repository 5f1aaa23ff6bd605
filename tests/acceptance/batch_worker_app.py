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
from worker_apps import run_until_stdin_closes

from dramatiq_reliable import (
    ClassifiedRetries,
    DeadLetters,
    Idempotency,
    OutboxBroker,
    PostgresBroker,
    WorkerRelay,
    build_middleware,
    job_connection,
)
from dramatiq_reliable.workflows import Batches

DATABASE_URL, SCHEMA, QUEUE = os.environ["DATABASE_URL"], os.environ["SCHEMA"], os.environ["QUEUE"]
THREADS = int(os.environ.get("THREADS", "4"))
# Many short retries: a Postgres cut must cost a delay, never a dead child (that would fail the batch).
middleware = build_middleware(
    middleware=[Idempotency(), DeadLetters(), Batches()],
    retries=ClassifiedRetries(max_retries=100, min_backoff=50, max_backoff=500),
)
broker: PostgresBroker | OutboxBroker
if os.environ["BROKER"] == "postgres":
    broker = PostgresBroker(
        database=DATABASE_URL, schema=SCHEMA, lease_ms=1500, pool_max_size=THREADS + 4, middleware=middleware
    )
else:
    broker = OutboxBroker(
        url=os.environ["RABBITMQ_URL"],
        database=DATABASE_URL,
        schema=SCHEMA,
        pool_max_size=THREADS + 4,
        middleware=middleware,
    )
    broker.add_middleware(WorkerRelay(poll_interval_ms=100))
dramatiq.set_broker(broker)

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
