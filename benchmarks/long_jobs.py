"""Long-jobs benchmark: what a Postgres lease costs per job, against the same jobs without one.

    python benchmarks/long_jobs.py [--n 1000] [--threads 8] [--rounds 3]

Every scenario drains a backlog of ``--n`` messages of an empty actor, published straight to
RabbitMQ before the worker starts (not through the outbox, so only the worker side is measured),
with an in-process worker of ``--threads`` threads on an ``OutboxBroker``:

  plain    the actor without a lease (``LongJobs`` on the broker, ``long_running=False``)
  leased   the same actor with ``long_running=True``: per job, the lease is written and
           committed, the delivery acked at once, and the lease deleted after the job

An empty actor is the worst case: a real long job runs for minutes, and the lease's two writes
disappear in it.  Scenarios alternate round by round so machine noise hits them alike; the rate
is ``n / (time from the worker's start to the last job's end)``.

The last line printed is one JSON object: ``leased_jobs_per_s`` and ``baseline_jobs_per_s``
(medians), ``ratio_to_baseline`` and every round's rates.
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
import pika
import psycopg
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.common import dq_name, xq_name
from psycopg import sql

from dramatiq_reliable import migrate
from dramatiq_reliable.outbox import LongJobs, OutboxBroker

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
RABBITMQ_URL = os.environ.get("RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
SCENARIOS = ("plain", "leased")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1000, help="messages per scenario and round")
    parser.add_argument("--threads", type=int, default=8, help="worker threads")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each running every scenario once")
    return parser.parse_args(argv)


def run_scenario(scenario: str, schema: str, n: int, threads: int) -> float:
    """Drain ``n`` messages of one scenario; jobs per second."""
    queue = f"bench_long_{uuid.uuid4().hex[:8]}"
    broker = OutboxBroker(url=RABBITMQ_URL, database=DATABASE_URL, schema=schema, pool_max_size=threads + 4)
    broker.add_middleware(LongJobs())
    done = threading.Event()
    count = [0]
    lock = threading.Lock()

    def job() -> None:
        with lock:
            count[0] += 1
            if count[0] == n:
                done.set()

    actor: Any = dramatiq.actor(
        job, broker=broker, queue_name=queue, actor_name=f"job_{queue}", long_running=scenario == "leased"
    )
    try:
        for _ in range(n):
            RabbitmqBroker.enqueue(broker, actor.message())
        worker = dramatiq.Worker(broker, worker_threads=threads, worker_timeout=100)
        started = time.perf_counter()
        worker.start()
        try:
            if not done.wait(600):
                raise RuntimeError(f"{scenario}: only {count[0]} of {n} jobs ran in 600 s")
            elapsed = time.perf_counter() - started
        finally:
            worker.stop()
    finally:
        channel = pika.BlockingConnection(pika.URLParameters(RABBITMQ_URL)).channel()
        for name in (queue, dq_name(queue), xq_name(queue)):
            channel.queue_delete(name)
        channel.connection.close()
        broker.close()
    return n / elapsed


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    schema = f"bench_long_{uuid.uuid4().hex[:8]}"
    migrate(DATABASE_URL, schema=schema)
    rates: dict[str, list[float]] = {scenario: [] for scenario in SCENARIOS}
    try:
        for round_number in range(args.rounds):
            for scenario in SCENARIOS if round_number % 2 == 0 else reversed(SCENARIOS):
                rate = run_scenario(scenario, schema, args.n, args.threads)
                rates[scenario].append(round(rate, 1))
                print(f"round {round_number + 1} {scenario}: {rate:.0f} jobs/s", flush=True)
    finally:
        with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
    leased, plain = statistics.median(rates["leased"]), statistics.median(rates["plain"])
    print(
        json.dumps(
            {
                "benchmark": "long_jobs",
                "n": args.n,
                "threads": args.threads,
                "leased_jobs_per_s": round(leased, 1),
                "baseline_jobs_per_s": round(plain, 1),
                "ratio_to_baseline": round(leased / plain, 3),
                "rounds": rates,
            }
        )
    )


if __name__ == "__main__":
    main()
