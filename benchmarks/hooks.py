"""Hook-by-hook profile of one job on the full middleware list, against plain Dramatiq's, in one thread.

    python benchmarks/hooks.py [--n 3000] [--rounds 3]

No RabbitMQ and no worker threads: each job is a ``MessageProxy`` taken through every
middleware's ``before_process_message`` (in list order), the one-INSERT actor, and every
``after_process_message`` (in reverse), as Dramatiq's ``WorkerThread`` does, on one thread, so
nothing waits for a core or the GIL.  Every hook is timed on its own, in wall time and in the
thread's CPU time (``time.thread_time_ns``: the Python work and the client side of its
statements; a statement's round trip is the wall minus the CPU).  Scenarios:

  plain   Dramatiq's default middleware on ``RabbitmqBroker``; the actor commits its INSERT
          on a pooled connection in a transaction of its own (``BEGIN``, ``INSERT``, ``COMMIT``)
  full    ``OutboxBroker`` with ``Tracing`` (no-op providers), ``Idempotency``, ``DeadLetters``,
          ``WorkerRelay`` (its thread not started: no worker boots) and ``ClassifiedRetries``;
          the actor's INSERT on ``job_connection()``, committed with the key

The acks, the consumer and the relay are not in it (``worker_side.py`` and ``end_to_end.py``
measure them).  The last line is one JSON object: per scenario, each hook's median µs per job
(``wall_us``, ``cpu_us``) and the totals; ``hooks_wall_ratio`` (plain total / full total).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid
from collections import defaultdict
from typing import Any

import dramatiq
import psycopg
from dramatiq.broker import MessageProxy
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.message import Message
from psycopg import sql

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
RABBITMQ_URL = os.environ.get("RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
ACTOR = "hooks_effect"


def build(scenario: str, schema: str) -> tuple[Any, Any, Any]:
    from opentelemetry import metrics, trace

    from dramatiq_reliable import (
        ClassifiedRetries,
        Database,
        DeadLetters,
        Idempotency,
        OutboxBroker,
        Tracing,
        WorkerRelay,
        build_middleware,
        job_connection,
    )

    insert = sql.SQL("INSERT INTO {} (n) VALUES (%s)").format(sql.Identifier(schema, "business"))
    if scenario == "plain":
        broker: Any = RabbitmqBroker(url=RABBITMQ_URL)
        database = Database(url=DATABASE_URL, max_size=2)

        def plain_fn(i: int) -> None:
            with database.connection() as conn, conn.transaction():
                conn.execute(insert, (i,))

        actor = dramatiq.actor(plain_fn, actor_name=ACTOR, queue_name=schema, broker=broker)
        return broker, actor, database.close
    front: list[Any] = [
        Tracing(tracer_provider=trace.NoOpTracerProvider(), meter_provider=metrics.NoOpMeterProvider()),
        Idempotency(),
        DeadLetters(),
        WorkerRelay(),
    ]
    broker = OutboxBroker(
        url=RABBITMQ_URL,
        database=DATABASE_URL,
        schema=schema,
        pool_max_size=2,
        middleware=build_middleware(retries=ClassifiedRetries(), middleware=front),
    )

    def full_fn(i: int) -> None:
        job_connection().execute(insert, (i,))

    actor = dramatiq.actor(full_fn, actor_name=ACTOR, queue_name=schema, broker=broker)
    return broker, actor, broker.close


def run(scenario: str, schema: str, n: int) -> dict[str, dict[str, float]]:
    """Per hook, the median µs per job over ``n`` jobs (after 100 untimed ones)."""
    broker, actor, close = build(scenario, schema)
    wall: dict[str, list[int]] = defaultdict(list)
    cpu: dict[str, list[int]] = defaultdict(list)
    try:
        before = [(f"before {type(m).__name__}", m.before_process_message) for m in broker.middleware]
        after = [(f"after {type(m).__name__}", m.after_process_message) for m in reversed(broker.middleware)]
        for i in range(-100, n):
            proxy = MessageProxy(Message(queue_name=schema, actor_name=ACTOR, args=(i,), kwargs={}, options={}))
            timed: list[tuple[str, int, int]] = []
            for name, hook in before:
                w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
                hook(broker, proxy)
                timed.append((name, time.perf_counter_ns() - w0, time.thread_time_ns() - c0))
            w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
            actor(i)
            timed.append(("actor", time.perf_counter_ns() - w0, time.thread_time_ns() - c0))
            for name, hook in after:
                w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
                hook(broker, proxy, result=None)
                timed.append((name, time.perf_counter_ns() - w0, time.thread_time_ns() - c0))
            if i >= 0:
                for name, w, c in timed:
                    wall[name].append(w)
                    cpu[name].append(c)
    finally:
        close()
    # Means, not medians: a statement's cost is in a minority of long samples (10 ms CPU ticks).
    return {
        name: {"wall_us": round(sum(wall[name]) / n / 1000, 1), "cpu_us": round(sum(cpu[name]) / n / 1000, 1)}
        for name in wall
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--n", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from dramatiq_reliable import migrate

    schema = f"bench_hooks_{uuid.uuid4().hex[:8]}"
    migrate(DATABASE_URL, schema=schema)
    rounds: dict[str, list[dict[str, dict[str, float]]]] = {"plain": [], "full": []}
    with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE TABLE {} (n int NOT NULL)").format(sql.Identifier(schema, "business")))
        try:
            for _ in range(args.rounds):
                for scenario in ("plain", "full"):  # interleaved: the same load hits both
                    rounds[scenario].append(run(scenario, schema, args.n))
                    print(scenario, json.dumps(rounds[scenario][-1]), flush=True)
        finally:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
    result: dict[str, Any] = {"n": args.n, "rounds": args.rounds, "load_average_1m": os.getloadavg()[0]}
    totals = {}
    for scenario, runs in rounds.items():
        hooks = {
            name: {key: round(statistics.median(r[name][key] for r in runs), 1) for key in ("wall_us", "cpu_us")}
            for name in runs[0]
        }
        totals[scenario] = {
            key: round(statistics.median(sum(h[key] for h in r.values()) for r in runs), 1)
            for key in ("wall_us", "cpu_us")
        }
        result[scenario] = {"hooks": hooks, "total": totals[scenario]}
    result["hooks_wall_ratio"] = round(totals["plain"]["wall_us"] / totals["full"]["wall_us"], 3)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
