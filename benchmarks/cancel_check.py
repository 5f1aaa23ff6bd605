"""Cancellation benchmark: worker throughput with and without the middleware's check, in one run.

    python benchmarks/cancel_check.py [--n 2000] [--threads 4] [--rounds 3]

Two scenarios per round, interleaved so that machine noise hits them alike, each on a
``PostgresBroker`` in a schema of its own with ``--n`` no-op messages queued before the worker
starts (so only processing is measured, from worker start until the last message is acked):
  1. without: ``build_middleware()`` and nothing else;
  2. with:    the same plus ``Cancellation()`` (one primary-key look-up per message) and
              ``--cancelled`` tombstones in ``job_cancellations`` (default 1000), none of them for
              these messages, so the look-up misses as it does for nearly every real message.
The last line printed is one JSON object with the median rates (messages/s) and
``cancel_check_ratio`` (with / without).  The schemas are dropped at the end.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
import uuid
from typing import Any

import dramatiq
import psycopg
from psycopg import sql

from dramatiq_reliable import Cancellation, PostgresBroker, build_middleware, migrate

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
SCENARIOS = ("without", "with")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=int(os.environ.get("CANCEL_BENCH_N", "2000")))
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cancelled", type=int, default=1000, help="tombstones of other messages")
    return parser.parse_args(argv)


def run_once(scenario: str, schema: str, n: int, threads: int) -> float:
    middleware: list[dramatiq.Middleware] = [Cancellation()] if scenario == "with" else []
    broker = PostgresBroker(
        database=DATABASE_URL,
        schema=schema,
        pool_max_size=threads + 4,
        middleware=build_middleware(middleware=middleware),
    )
    queue = f"bench_{uuid.uuid4().hex[:8]}"
    done: list[int] = []
    try:
        actor = dramatiq.actor(lambda: done.append(1), actor_name=f"{queue}_noop", queue_name=queue, broker=broker)
        with broker.transaction():
            for _ in range(n):
                actor.send()
        worker = dramatiq.Worker(broker, worker_timeout=50, worker_threads=threads)
        start = time.perf_counter()
        worker.start()
        try:
            broker.join(queue, timeout=600_000)
            elapsed = time.perf_counter() - start
        finally:
            worker.stop()
    finally:
        broker.close()
    assert len(done) == n, f"{scenario}: ran {len(done)} of {n}"
    return n / elapsed


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    schemas = {scenario: f"bench_cancel_{scenario}_{uuid.uuid4().hex[:6]}" for scenario in SCENARIOS}
    rates: dict[str, list[float]] = {scenario: [] for scenario in SCENARIOS}
    try:
        for schema in schemas.values():
            migrate(DATABASE_URL, schema=schema)
        with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
            conn.execute(
                sql.SQL(
                    "INSERT INTO {} (message_id, cancelled_by, found_in) "
                    "SELECT gen_random_uuid()::text, 'bench', 'in_flight' FROM generate_series(1, %s)"
                ).format(sql.Identifier(schemas["with"], "job_cancellations")),
                (args.cancelled,),
            )
        for _ in range(args.rounds):
            for scenario in SCENARIOS:
                rates[scenario].append(run_once(scenario, schemas[scenario], args.n, args.threads))
    finally:
        with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
            for schema in schemas.values():
                conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
    medians = {scenario: statistics.median(values) for scenario, values in rates.items()}
    summary = {
        "benchmark": "cancel_check",
        "n": args.n,
        "threads": args.threads,
        "rounds": args.rounds,
        "without_per_s": round(medians["without"], 1),
        "with_per_s": round(medians["with"], 1),
        "cancel_check_ratio": round(medians["with"] / medians["without"], 3),
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
