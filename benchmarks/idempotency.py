"""Idempotency benchmark: worker throughput with and without the middleware, side by side in one run.

    python benchmarks/idempotency.py [--n 10000] [--threads 8] [--rounds 3] [--prefix bench_idem_]
    IDEMPOTENCY_BENCH_N=1000 python benchmarks/idempotency.py

Seven scenarios per round, interleaved so that machine noise hits them alike:
  1. db_without:         plain RabbitmqBroker; the actor borrows a pooled connection, opens a
                         transaction, inserts one business row and commits (what a careful actor
                         does anyway);
  2. db_with:            the same broker plus ``Idempotency`` (transactional); the actor inserts its
                         row on the job connection, so the key is one more statement in a
                         transaction that commits anyway;
  3. noop_without:       an actor that does nothing;
  4. noop_with:          the same with ``Idempotency`` in its default, transactional mode (BEGIN,
                         key INSERT, COMMIT per message);
  5. noop_record:        the same no-op actor in record mode, the mode the docs recommend for an
                         actor whose effects are outside Postgres: an autocommit lookup before the
                         actor, an autocommit key INSERT after it (reported so that neither figure
                         is hidden; on 2 cores it is not faster: docs/idempotency.md, "Speed");
  6. db_key_raw:         the ceiling for 2, no middleware: scenario 1's actor runs the claim
                         statement itself before its INSERT (what a durable key needs, nothing else);
  7. noop_key_raw:       the ceiling for 4: an actor that only borrows a pooled connection and
                         commits the claim statement in a transaction (BEGIN, INSERT, COMMIT).
Every scenario gets its own queue, pre-filled with ``--n`` messages published straight to
RabbitMQ (not through the outbox), so only processing is measured: wall time from worker start
until the actor has run ``--n`` times.  The last line printed is one JSON object with the median
rates (messages/s) and the ratios with/without: ``db_actor_ratio`` (2 / 1), ``noop_ratio``
(4 / 3), ``noop_record_ratio`` (5 / 3), and the ceilings ``db_ceiling_ratio`` (6 / 1) and
``noop_ceiling_ratio`` (7 / 3): a middleware doing no work of its own beyond the claim would
reach those.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import dramatiq
import psycopg
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.message import Message
from dramatiq.middleware import Callbacks
from psycopg import sql

from dramatiq_reliable import Database, Idempotency, _sql, job_connection, migrate
from dramatiq_reliable.idempotency import payload_hash

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
RABBITMQ_URL = os.environ.get("RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
SCENARIOS = ("db_without", "db_with", "noop_without", "noop_with", "noop_record", "db_key_raw", "noop_key_raw")


def log(text: str) -> None:
    print(text, flush=True)


class Counter:
    """Counts actor runs across worker threads."""

    def __init__(self) -> None:
        self.value = 0
        self._lock = threading.Lock()

    def add(self) -> None:
        with self._lock:
            self.value += 1


def prefill(queue: str, actor_name: str, n: int) -> None:
    """Publish ``n`` messages for ``actor_name`` straight to RabbitMQ, bypassing any outbox."""
    publisher = RabbitmqBroker(url=RABBITMQ_URL, middleware=[])
    try:
        publisher.declare_queue(queue, ensure=True)
        for i in range(n):
            publisher.enqueue(Message(queue_name=queue, actor_name=actor_name, args=(i,), kwargs={}, options={}))
    finally:
        publisher.close()


def run_scenario(scenario: str, *, n: int, threads: int, schema: str, prefix: str = "bench_idem_") -> float:
    """Process ``n`` pre-published messages in a fresh worker; return messages/s."""
    queue = f"{prefix}{uuid.uuid4().hex[:10]}"
    actor_name = f"{scenario}_actor"
    broker = RabbitmqBroker(url=RABBITMQ_URL)
    with_idempotency = scenario.endswith(("_with", "_record"))
    idempotency = None
    if with_idempotency:
        mode = "record" if scenario == "noop_record" else "transactional"
        idempotency = Idempotency(database=DATABASE_URL, schema=schema, default_mode=mode)
        broker.add_middleware(idempotency, before=Callbacks)
    # The baseline actor gets the same pool shape the middleware uses (Database's default).
    database = Database(url=DATABASE_URL)
    insert = sql.SQL("INSERT INTO {} (n) VALUES (%s)").format(sql.Identifier(schema, "business"))
    done = Counter()
    fn: Callable[[int], None]

    if scenario == "db_without":

        def fn(i: int) -> None:
            with database.connection() as conn, conn.transaction():
                conn.execute(insert, (i,))
            done.add()

    elif scenario in ("db_key_raw", "noop_key_raw"):
        claim = _sql.rendered("idempotency_claim", schema)
        business = scenario == "db_key_raw"

        def fn(i: int) -> None:
            key = str(uuid.uuid4())  # random, as the message ids the middleware uses are
            params = {
                "actor_name": actor_name,
                "job_key": key,
                "payload_hash": payload_hash((i,), {}),
                "message_id": key,
                "retention_s": 604_800.0,
            }
            with database.connection() as conn, conn.transaction():
                conn.execute(claim, params).fetchone()
                if business:
                    conn.execute(insert, (i,))
            done.add()

    elif scenario == "db_with":

        def fn(i: int) -> None:
            job_connection().execute(insert, (i,))
            done.add()

    else:

        def fn(i: int) -> None:
            done.add()

    dramatiq.actor(fn, actor_name=actor_name, queue_name=queue, broker=broker)
    prefill(queue, actor_name, n)
    worker = dramatiq.Worker(broker, worker_threads=threads, worker_timeout=100)
    started = time.perf_counter()
    worker.start()
    try:
        deadline = started + max(120.0, n / 50)
        while done.value < n:
            if time.perf_counter() > deadline:
                raise RuntimeError(f"{scenario}: only {done.value} of {n} messages processed in time")
            time.sleep(0.002)
        elapsed = time.perf_counter() - started
    finally:
        worker.stop()
        broker.close()
        database.close()
        if idempotency is not None:
            idempotency.close()
    _delete_queue(queue)
    return n / elapsed


def _delete_queue(queue: str) -> None:
    cleaner = RabbitmqBroker(url=RABBITMQ_URL, middleware=[])
    try:
        channel = cleaner.channel
        for name in (queue, f"{queue}.DQ", f"{queue}.XQ"):
            channel.queue_delete(name)
    finally:
        cleaner.close()


def reset(schema: str) -> None:
    with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
        conn.execute(
            sql.SQL("TRUNCATE {}, {}").format(
                sql.Identifier(schema, "business"), sql.Identifier(schema, "processed_jobs")
            )
        )
        conn.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(schema, "processed_jobs")))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--n", type=int, default=int(os.environ.get("IDEMPOTENCY_BENCH_N", "10000")))
    parser.add_argument("--threads", type=int, default=8, help="worker threads (Dramatiq's default: 8)")
    parser.add_argument("--rounds", type=int, default=int(os.environ.get("IDEMPOTENCY_BENCH_ROUNDS", "3")))
    parser.add_argument("--prefix", default="bench_idem_", help="schema and queue name prefix")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("pika").setLevel(logging.CRITICAL)

    schema = f"{args.prefix}{uuid.uuid4().hex[:8]}"
    migrate(DATABASE_URL, schema=schema)
    with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE TABLE {} (id bigserial PRIMARY KEY, n int NOT NULL)").format(
                sql.Identifier(schema, "business")
            )
        )
    rates: dict[str, list[float]] = {name: [] for name in SCENARIOS}
    log(f"n={args.n} threads={args.threads} rounds={args.rounds} cpus={os.cpu_count()}")
    try:
        for round_number in range(1, args.rounds + 1):
            for scenario in SCENARIOS:
                reset(schema)
                rate = run_scenario(scenario, n=args.n, threads=args.threads, schema=schema, prefix=args.prefix)
                rates[scenario].append(rate)
                log(f"round {round_number} {scenario:<18} {rate:9.0f} msg/s")
    finally:
        with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))

    median = {name: statistics.median(values) for name, values in rates.items()}
    results: dict[str, Any] = {
        "n": args.n,
        "threads": args.threads,
        "rounds": args.rounds,
        **{f"{name}_rate": round(value, 1) for name, value in median.items()},
        **{f"{name}_rates": [round(v, 1) for v in values] for name, values in rates.items()},
        "db_actor_ratio": round(median["db_with"] / median["db_without"], 3),
        "noop_ratio": round(median["noop_with"] / median["noop_without"], 3),
        "noop_record_ratio": round(median["noop_record"] / median["noop_without"], 3),
        "db_ceiling_ratio": round(median["db_key_raw"] / median["db_without"], 3),
        "noop_ceiling_ratio": round(median["noop_key_raw"] / median["noop_without"], 3),
    }
    log(json.dumps(results))


if __name__ == "__main__":
    main()
