"""Order per key: 10,000 jobs over 100 keys, no job out of its key's order, and the price against unordered.

    python benchmarks/flow_order.py [--jobs 10000] [--keys 100] [--threads 8] [--broker postgres|outbox] [--rounds 3]

Each run (in a schema of its own, dropped afterwards) sends ``--jobs`` jobs round-robin over
``--keys`` keys in transactions of 500, then drains them with one in-process worker of
``--threads`` threads; the job only records its key and number.  A round is two runs: the actor
without ``order_key`` (OrderedKeys installed all the same) and with ``order_key``, the two
alternating which goes first, so that a machine shared with other work slows both alike.  A
violation is a job that started before the job sent before it on its key had finished, or ran
out of its key's send order.  The last line printed is one JSON object: ``order_violations``
(over every ordered run), ``ordered_ratio`` (the median over rounds of ordered drain rate /
unordered drain rate of the same round), ``ordered_ratio_min`` / ``ordered_ratio_max``, the
per-round ratios, the median rates and the load average.  benchmarks/flow_control.py imports
:func:`measure_order`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
import uuid
from typing import Any

import dramatiq
import psycopg
from dramatiq.middleware import Callbacks
from psycopg import sql

from dramatiq_reliable import OrderedKeys, OutboxBroker, PostgresBroker, WorkerRelay, migrate

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
RABBITMQ_URL = os.environ.get("RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
BATCH = 500


def _broker(kind: str, schema: str, threads: int) -> Any:
    if kind == "outbox":
        broker: Any = OutboxBroker(url=RABBITMQ_URL, database=DATABASE_URL, schema=schema, pool_max_size=threads + 6)
        broker.add_middleware(WorkerRelay())
    else:
        broker = PostgresBroker(database=DATABASE_URL, schema=schema, pool_max_size=threads + 6)
    broker.add_middleware(OrderedKeys(), before=Callbacks)
    return broker


def _run(kind: str, *, jobs: int, keys: int, threads: int, ordered: bool) -> dict[str, Any]:
    """One run: send, drain, and check each key's runs against its send order."""
    schema = f"bench_{uuid.uuid4().hex[:8]}"
    queue = f"flow_order_{uuid.uuid4().hex[:8]}"
    migrate(DATABASE_URL, schema=schema)
    broker = _broker(kind, schema, threads)
    lock = threading.Lock()
    runs: list[tuple[int, int, float, float]] = []
    done = threading.Event()

    def job(key: int, n: int) -> None:
        started = time.monotonic()
        with lock:
            runs.append((key, n, started, time.monotonic()))
            if len(runs) == jobs:
                done.set()

    options: dict[str, Any] = {"order_key": lambda key, n: f"k{key}"} if ordered else {}
    actor = dramatiq.actor(job, actor_name="job", queue_name=queue, broker=broker, max_retries=0, **options)
    try:
        sent_at = time.monotonic()
        for start in range(0, jobs, BATCH):
            with broker.transaction():
                for n in range(start, min(start + BATCH, jobs)):
                    actor.send(n % keys, n)
        send_s = time.monotonic() - sent_at
        worker = dramatiq.Worker(broker, worker_threads=threads, worker_timeout=20)
        began = time.monotonic()
        worker.start()
        try:
            if not done.wait(600):
                raise SystemExit(f"only {len(runs)} of {jobs} jobs ran in 600 s")
            drain_s = time.monotonic() - began
        finally:
            worker.stop()
    finally:
        broker.close()
        with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
    violations = 0
    last: dict[int, tuple[int, float]] = {}
    for key, n, started, finished in sorted(runs, key=lambda run: run[2]):
        previous = last.get(key)
        if previous is not None and (n < previous[0] or started < previous[1]):
            violations += 1
        last[key] = (n, finished)
    return {"violations": violations, "drain_per_s": jobs / drain_s, "send_per_s": jobs / send_s}


def measure_order(
    *, jobs: int = 10_000, keys: int = 100, threads: int = 8, broker: str = "postgres", rounds: int = 3
) -> dict[str, Any]:
    """Ordered against unordered on ``broker``, interleaved over ``rounds``: ``order_violations`` (every
    ordered run) and ``ordered_ratio`` (the median of the rounds' ratios, with its min and max)."""
    ratios: list[float] = []
    plain_rates: list[float] = []
    ordered_rates: list[float] = []
    violations = 0
    for round_ in range(rounds):
        results: dict[bool, dict[str, Any]] = {}
        for ordered in (False, True) if round_ % 2 == 0 else (True, False):
            results[ordered] = _run(broker, jobs=jobs, keys=keys, threads=threads, ordered=ordered)
        violations += results[True]["violations"]
        plain_rates.append(results[False]["drain_per_s"])
        ordered_rates.append(results[True]["drain_per_s"])
        ratios.append(results[True]["drain_per_s"] / results[False]["drain_per_s"])
    return {
        "broker": broker,
        "jobs": jobs,
        "keys": keys,
        "threads": threads,
        "rounds": rounds,
        "order_violations": violations,
        "ordered_ratio": round(statistics.median(ratios), 3),
        "ordered_ratio_min": round(min(ratios), 3),
        "ordered_ratio_max": round(max(ratios), 3),
        "ordered_ratios": [round(ratio, 3) for ratio in ratios],
        "ordered_drain_per_s": round(statistics.median(ordered_rates), 1),
        "unordered_drain_per_s": round(statistics.median(plain_rates), 1),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--keys", type=int, default=100)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--broker", choices=("postgres", "outbox"), default="postgres")
    parser.add_argument("--rounds", type=int, default=3)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print(
        json.dumps(
            measure_order(jobs=args.jobs, keys=args.keys, threads=args.threads, broker=args.broker, rounds=args.rounds)
        )
    )


if __name__ == "__main__":
    main()
