"""A worker process for the quorum acceptance tests: an OutboxBroker worker on quorum queues.

``poison(n)`` records its start in ``runs`` and then SIGKILLs its own worker process, as a job
that segfaults or meets the OOM killer would; ``fine(n)`` records a finished run.  The queue type,
the delivery limit and the RabbitMQ URLs (``;``-separated) come from the environment.
"""

from __future__ import annotations

import os
import signal

import dramatiq
import psycopg
from psycopg import sql
from worker_apps import run_until_stdin_closes

from dramatiq_reliable import DeadLetters, OutboxBroker

DATABASE_URL, SCHEMA, QUEUE = os.environ["DATABASE_URL"], os.environ["SCHEMA"], os.environ["QUEUE"]
broker = OutboxBroker(
    url=os.environ["RABBITMQ_URLS"],
    database=DATABASE_URL,
    schema=SCHEMA,
    queue_type="quorum",
    delivery_limit=int(os.environ.get("DELIVERY_LIMIT", "20")),
)
broker.add_middleware(DeadLetters())
dramatiq.set_broker(broker)
RUNS = sql.Identifier(SCHEMA, "runs")


def _record(actor: str, n: int) -> None:
    with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
        conn.execute(
            sql.SQL("INSERT INTO {} (actor, n, pid) VALUES (%s, %s, %s)").format(RUNS), (actor, n, os.getpid())
        )


@dramatiq.actor(queue_name=QUEUE, actor_name="poison", max_retries=0)
def poison(n: int) -> None:
    _record("poison", n)
    os.kill(os.getpid(), signal.SIGKILL)


@dramatiq.actor(queue_name=QUEUE, actor_name="fine", max_retries=3)
def fine(n: int) -> None:
    _record("fine", n)


if __name__ == "__main__":
    run_until_stdin_closes(broker, threads=1, prefetch=1)  # one message at a time: a kill returns only it
