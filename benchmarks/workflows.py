"""Batches benchmark: a batch's children through a real worker vs plain messages, and callback latency.

    python benchmarks/workflows.py [--n 10000] [--threads 8] [--rounds 3] [--batches 30] [--batch-size 20]

On a ``PostgresBroker`` with ``Idempotency`` (transactional) and ``Batches``, each phase in a fresh schema
(a second phase in the same schema runs about a third slower, whichever it is):
  1. plain: ``--n`` no-op messages sent in one transaction, then drained by a worker of
     ``--threads`` threads (worker start to the last ack);
  2. batch: the same ``--n`` messages added to one ``Batch`` in one transaction, drained the same way
     until its callback has run (every child counts itself and the last one sends the callback).
  ``batch_ratio`` is (plain time) / (batch time): 1.0 means the counting costs nothing.  The send side
  (``send_ratio``) is reported too: a child is one more statement in the sender's transaction.
  A round is one plain phase and one batch phase, and which of the two goes first alternates from
  round to round (plain first, then batch first, ...), as in benchmarks/flow_order.py: a shared
  machine's load lands on both alike, and neither is always the one that starts on a warm (or
  busy) server.  Each ratio is a round's; the line gives their median (``batch_ratio``), every
  round's (``batch_ratios``), the spread (``batch_ratio_min``/``batch_ratio_max`` and
  ``batch_ratio_spread``, max - min) and the load average before and after.  Read a median whose
  spread is wider than the difference you look for as noise, not as a result.
  3. latency: ``--batches`` batches of ``--batch-size`` children, one after the other; for each, the
     time from the last child's count (its ``finished_at``, Postgres' clock) to the callback starting
     (``clock_timestamp()`` read by the callback, same clock).  ``callback_p99_ms`` is their p99.
The last line printed is one JSON object.  The schemas are dropped at the end.
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
from typing import Any

import dramatiq
import psycopg
from dramatiq.middleware import Callbacks
from psycopg import sql

from dramatiq_reliable import Batch, Batches, Idempotency, PostgresBroker, migrate
from dramatiq_reliable.binding import bound_connection
from dramatiq_reliable.testing import wait_for

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=int(os.environ.get("WORKFLOWS_BENCH_N", "10000")))
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument(
        "--rounds", type=int, default=3, help="plain/batch pairs, interleaved, the first of each alternating"
    )
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=20)
    return parser.parse_args(argv)


def new_broker(schema: str, threads: int) -> PostgresBroker:
    broker = PostgresBroker(database=DATABASE_URL, schema=schema, pool_max_size=threads + 4)
    broker.add_middleware(Idempotency(), before=Callbacks)
    broker.add_middleware(Batches())
    return broker


def drain(broker: PostgresBroker, threads: int, done: threading.Event) -> float:
    worker = dramatiq.Worker(broker, worker_timeout=20, worker_threads=threads)
    start = time.perf_counter()
    worker.start()
    try:
        if not done.wait(timeout=900):
            raise RuntimeError("the worker did not finish in 15 minutes")
        return time.perf_counter() - start
    finally:
        worker.stop()


def phase(kind: str, schema: str, n: int, threads: int) -> tuple[float, float]:
    """Send ``n`` no-op children (``kind`` "plain" or "batch") in one transaction, then drain them:
    (send seconds, drain seconds).  Each phase has a fresh schema: the queue table's dead rows of
    one phase must not slow the other."""
    broker = new_broker(schema, threads)
    finished = threading.Event()
    count = [0]
    lock = threading.Lock()

    @dramatiq.actor(queue_name="bench", broker=broker)
    def child(i: int) -> None:
        with lock:
            count[0] += 1
            if kind == "plain" and count[0] == n:
                finished.set()

    @dramatiq.actor(queue_name="bench", broker=broker)
    def report() -> None:
        finished.set()

    try:
        start = time.perf_counter()
        if kind == "batch":
            batch = Batch(callback=report.message(), broker=broker)
            with broker.transaction(), batch:
                for i in range(n):
                    batch.add(child.message(i))
        else:
            with broker.transaction():
                for i in range(n):
                    child.send(i)
        sent = time.perf_counter() - start
        return sent, drain(broker, threads, finished)
    finally:
        broker.close()


def latencies(schema: str, batches: int, size: int, threads: int) -> list[float]:
    broker = new_broker(schema, threads)
    seen: list[float] = []

    @dramatiq.actor(queue_name="latency", broker=broker)
    def noop(i: int) -> None:
        pass

    @dramatiq.actor(queue_name="latency", broker=broker)
    def callback(batch_id: str) -> None:
        conn = bound_connection()  # the callback's own job transaction (Idempotency)
        assert conn is not None
        row = conn.execute(
            sql.SQL(
                "SELECT extract(epoch FROM clock_timestamp() - max(finished_at)) * 1000 FROM {} WHERE batch_id = %s"
            ).format(sql.Identifier(schema, "batch_children")),
            (batch_id,),
        ).fetchone()
        assert row is not None
        seen.append(float(row[0]))

    worker = dramatiq.Worker(broker, worker_timeout=20, worker_threads=threads)
    worker.start()
    try:
        for b in range(batches):
            batch_id = str(uuid.uuid4())
            batch = Batch(callback=callback.message(batch_id), broker=broker, id=batch_id)
            with broker.transaction(), batch:
                for i in range(size):
                    batch.add(noop.message(b * size + i))
            wait_for(lambda b=b: len(seen) == b + 1, timeout_ms=60_000, message=f"batch {b} never fired")
    finally:
        worker.stop()
        broker.close()
    return seen


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    # Plain first in even rounds, batch first in odd ones.
    kinds = [
        f"{kind}{r}" for r in range(args.rounds) for kind in (("plain", "batch") if r % 2 == 0 else ("batch", "plain"))
    ]
    schemas = {kind: f"bench_workflows_{kind}_{uuid.uuid4().hex[:6]}" for kind in [*kinds, "latency"]}
    load = os.getloadavg()[0]
    try:
        for schema in schemas.values():
            migrate(DATABASE_URL, schema=schema)
        runs = {kind: phase(kind.rstrip("0123456789"), schemas[kind], args.n, args.threads) for kind in kinds}
        waits = sorted(latencies(schemas["latency"], args.batches, args.batch_size, args.threads))
    finally:
        with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
            for schema in schemas.values():
                conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
    ratios = [runs[f"plain{r}"][1] / runs[f"batch{r}"][1] for r in range(args.rounds)]
    send_ratios = [runs[f"plain{r}"][0] / runs[f"batch{r}"][0] for r in range(args.rounds)]
    plain = statistics.median(runs[f"plain{r}"][1] for r in range(args.rounds))
    batched = statistics.median(runs[f"batch{r}"][1] for r in range(args.rounds))
    p99 = waits[min(len(waits) - 1, round(0.99 * (len(waits) - 1)))]
    summary = {
        "benchmark": "workflows",
        "n": args.n,
        "threads": args.threads,
        "rounds": args.rounds,
        "plain_per_s": round(args.n / plain, 1),
        "batch_per_s": round(args.n / batched, 1),
        "batch_ratio": round(statistics.median(ratios), 3),
        "batch_ratio_min": round(min(ratios), 3),
        "batch_ratio_max": round(max(ratios), 3),
        "batch_ratio_spread": round(max(ratios) - min(ratios), 3),
        "batch_ratios": [round(ratio, 3) for ratio in ratios],
        "send_ratio": round(statistics.median(send_ratios), 3),
        "batches": args.batches,
        "batch_size": args.batch_size,
        "callback_p50_ms": round(statistics.median(waits), 1),
        "callback_p99_ms": round(p99, 1),
        "load_1m": [round(load, 1), round(os.getloadavg()[0], 1)],
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
