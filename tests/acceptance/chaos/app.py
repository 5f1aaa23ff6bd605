"""The Dramatiq app the chaos worker processes run (``dramatiq chaos.app``).

Configured by the environment the harness sets (a test app, not the library, so reading it is
fine): ``CHAOS_DATABASE_URL`` and ``CHAOS_RABBITMQ_URL`` (through the harness's proxies; on a
cluster, every node's URL, ``;``-separated), ``CHAOS_SCHEMA``, ``CHAOS_QUEUE``, ``CHAOS_QUEUE_TYPE``,
``CHAOS_SEED``, ``CHAOS_FAIL_RATE`` and ``CHAOS_WORK_MS``.

The actor's effect is one row in ``chaos_effects`` per run that committed, written on the job's
connection, so it commits with the idempotency key or not at all.  The table has no unique
constraint: a second effect for an order is a row the ledger can count, not an error that hides it.
"""

from __future__ import annotations

import hashlib
import os
import time

import dramatiq
from dramatiq.middleware import CurrentMessage
from psycopg import sql

from dramatiq_reliable import (
    ClassifiedRetries,
    DeadLetters,
    Idempotency,
    OutboxBroker,
    Unrecoverable,
    build_middleware,
    job_connection,
)

from . import ACTOR_NAME

DATABASE_URL = os.environ["CHAOS_DATABASE_URL"]
#: One URL, or several separated by ``;`` (a cluster's nodes, this worker's first node first).
RABBITMQ_URLS = os.environ["CHAOS_RABBITMQ_URL"].split(";")
SCHEMA = os.environ["CHAOS_SCHEMA"]
QUEUE = os.environ["CHAOS_QUEUE"]
SEED = int(os.environ.get("CHAOS_SEED", "0"))
FAIL_RATE = float(os.environ.get("CHAOS_FAIL_RATE", "0.05"))
WORK_MS = int(os.environ.get("CHAOS_WORK_MS", "20"))
THREADS = int(os.environ.get("CHAOS_THREADS", "4"))
QUEUE_TYPE = os.environ.get("CHAOS_QUEUE_TYPE", "classic")

broker = OutboxBroker(
    url=RABBITMQ_URLS,
    # Classic is Dramatiq's own declare; quorum is OutboxBroker's (the relays get --queue-type).
    **({"queue_type": QUEUE_TYPE} if QUEUE_TYPE != "classic" else {}),
    database=DATABASE_URL,
    schema=SCHEMA,
    pool_max_size=THREADS + 4,
    middleware=build_middleware(
        middleware=[CurrentMessage(), Idempotency(), DeadLetters()],
        # Short backoffs so a run drains in seconds; 20 attempts as in the scenario.
        retries=ClassifiedRetries(max_retries=20, min_backoff=100, max_backoff=1000),
    ),
)
dramatiq.set_broker(broker)

_INSERT = sql.SQL("INSERT INTO {}.chaos_effects (order_id, message_id, pid) VALUES (%s, %s, %s)").format(
    sql.Identifier(SCHEMA)
)


def roll(order_id: int, attempt: int) -> float:
    """A number in [0, 1) fixed by the seed, the order and the attempt: the same on a redelivery."""
    digest = hashlib.sha256(f"{SEED}:{order_id}:{attempt}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


@dramatiq.actor(actor_name=ACTOR_NAME, queue_name=QUEUE, idempotency_key=lambda order_id, poison: f"order-{order_id}")
def chaos_effect(order_id: int, poison: bool) -> None:
    if poison:
        raise Unrecoverable(f"order {order_id} is poison: a permanent failure, dead-lettered on its first attempt")
    message = CurrentMessage.get_current_message()
    attempt = int(message.options.get("retries", 0)) if message is not None else 0
    chance = roll(order_id, attempt)
    if chance < FAIL_RATE / 2:
        raise TimeoutError(f"injected transient failure of order {order_id} before its write (attempt {attempt})")
    job_connection().execute(_INSERT, (order_id, message.message_id if message else None, os.getpid()))
    if chance < FAIL_RATE:
        raise ConnectionError(f"injected transient failure of order {order_id} after its write (attempt {attempt})")
    # The work between the write and the COMMIT: a cut of Postgres in this window makes the
    # commit's outcome unknown, the case the chaos suite exists for.
    time.sleep(WORK_MS / 1000)
