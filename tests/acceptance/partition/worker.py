"""A worker inside the namespace, with the documented middleware and one thread.

Its actor writes one effect row per order on the job's connection (so the row commits with the
idempotency key or not at all).  Order ``n`` with ``hold=True`` on its first attempt waits, after
its write and before its commit, until the file ``release`` names exists, so the test can cut
Postgres mid-job.  RabbitMQ connection errors of the consumer are reported as ``consumer_error``.
"""

from __future__ import annotations

import logging
import os
import sys
import time

import dramatiq
from common import config, emit
from dramatiq.middleware import CurrentMessage
from psycopg import sql

from dramatiq_reliable import (
    ClassifiedRetries,
    DeadLetters,
    Idempotency,
    OutboxBroker,
    build_middleware,
    job_connection,
)

settings = config()
SCHEMA = settings["schema"]
broker = OutboxBroker(
    url=settings["rabbitmq_url"],
    database=settings["database_url"],
    schema=SCHEMA,
    pool_max_size=6,
    middleware=build_middleware(
        middleware=[CurrentMessage(), Idempotency(), DeadLetters()],
        retries=ClassifiedRetries(max_retries=20, min_backoff=100, max_backoff=1000),
    ),
)
dramatiq.set_broker(broker)
_INSERT = sql.SQL("INSERT INTO {}.partition_effects (order_id, attempt) VALUES (%s, %s)").format(sql.Identifier(SCHEMA))


@dramatiq.actor(
    queue_name=settings["queue"], actor_name="partition_effect", idempotency_key=lambda n, hold: f"order-{n}"
)
def effect(n: int, hold: bool) -> None:
    message = CurrentMessage.get_current_message()
    attempt = int(message.options.get("retries", 0)) if message is not None else 0
    job_connection().execute(_INSERT, (n, attempt))
    emit("ran", n=n, attempt=attempt)
    if hold and attempt == 0:
        while not os.path.exists(settings["release"]):
            time.sleep(0.05)
        emit("released", n=n)


class _Report(logging.Handler):
    """Dramatiq logs a consumer's lost connection as "Consumer encountered a connection error"."""

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "connection error" in text.lower() or "Restarting consumer" in text:
            emit("consumer_error", message=text[:300])


logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
logging.getLogger("dramatiq").addHandler(_Report())

if __name__ == "__main__":
    worker = dramatiq.Worker(broker, worker_threads=1, worker_timeout=100)
    broker.emit_after("process_boot")
    worker.start()
    emit("ready")
    try:
        sys.stdin.read()
    finally:
        worker.stop()
        broker.close()
