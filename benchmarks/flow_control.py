"""Flow-control benchmark: a key limited across worker processes, and what the middleware costs the rest.

    python benchmarks/flow_control.py [--seconds 60] [--rate 50] [--workers 4] [--threads 4]

1. **Limited**: ``--workers`` worker processes (PostgresBroker, ``RateLimits``) hammer one key
   limited at ``--rate`` per second (burst 1) while a producer sends ``--send-rate`` jobs a
   second (twice the limit), so a backlog grows all along.  Each job records its start in
   Postgres (one clock for every process).  Over the first ``--seconds`` of calls: ``limit_peak_ratio`` is the most calls in any 1 s sliding window over
   the rate, ``limit_throughput_ratio`` the calls per second achieved over the rate.
2. **Unlimited**: ``--unlimited-jobs`` jobs of an actor with no ``rate_limit``, drained by the
   same processes with ``RateLimits`` installed and without (best of ``--rounds`` each);
   ``unlimited_ratio`` is with over without.  On a shared machine that ratio is mostly noise,
   so ``unlimited_hook_ns`` also gives what the two hooks cost such a job, timed in process.
3. **Order** (``benchmarks/flow_order.py``, when present): its ``measure_order()`` figures,
   ``order_violations`` and ``ordered_ratio``; ``null`` when it is not there.

Each run uses a schema of its own, dropped afterwards.  The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import dramatiq
import psycopg
from psycopg import sql

from dramatiq_reliable import ClassifiedRetries, PostgresBroker, build_middleware, migrate
from dramatiq_reliable.flow import RateLimit, RateLimits

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
HERE = Path(__file__).resolve()


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=int, default=60, help="how long the limited key is hammered (default 60)")
    parser.add_argument("--rate", type=int, default=50, help="the key's limit per second (default 50)")
    parser.add_argument(
        "--send-rate", type=int, default=100, help="jobs sent per second while it runs (default 100: twice the limit)"
    )
    parser.add_argument("--workers", type=int, default=4, help="worker processes (default 4)")
    parser.add_argument("--threads", type=int, default=4, help="threads per worker process (default 4)")
    parser.add_argument("--poll-ms", type=int, default=100, help="the workers' worker_timeout (default 100)")
    parser.add_argument("--unlimited-jobs", type=int, default=3000, help="jobs of the unlimited runs (default 3000)")
    parser.add_argument("--rounds", type=int, default=3, help="unlimited runs with and without (default 3)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# -- the worker processes ----------------------------------------------------------------------------


def _broker(schema: str, *, limited: bool, rate: int) -> PostgresBroker:
    front = [RateLimits([RateLimit("api", per_second=rate)])] if limited else []
    return PostgresBroker(
        database=DATABASE_URL,
        schema=schema,
        middleware=build_middleware(retries=ClassifiedRetries(max_retries=0), middleware=front),
    )


def _declare(broker: PostgresBroker, schema: str, queue: str, *, limited: bool) -> dramatiq.Actor[Any, Any]:
    calls = sql.SQL("INSERT INTO {} (n, pid) VALUES (%s, %s)").format(sql.Identifier(schema, "calls"))
    options: dict[str, Any] = {"rate_limit": "api"} if limited else {}

    def call(n: int) -> None:
        with broker.database.autocommit() as conn:
            conn.execute(calls, (n, os.getpid()))

    return dramatiq.actor(call, actor_name="call", queue_name=queue, broker=broker, **options)


def worker_main() -> None:
    """A worker process: settings in the environment, stopped by closing its stdin."""
    schema, queue = os.environ["SCHEMA"], os.environ["QUEUE"]
    # Dramatiq logs every skipped message (each postponement) as a warning.
    logging.getLogger("dramatiq.worker.WorkerThread").setLevel(logging.ERROR)
    installed, limited = os.environ["INSTALLED"] == "1", os.environ["LIMITED"] == "1"
    broker = _broker(schema, limited=installed, rate=int(os.environ["RATE"]))
    _declare(broker, schema, queue, limited=limited)
    worker = dramatiq.Worker(broker, worker_threads=int(os.environ["THREADS"]), worker_timeout=int(os.environ["POLL"]))
    worker.start()
    print("ready", flush=True)
    try:
        sys.stdin.read()
    finally:
        worker.stop()
        broker.close()


def _start(args: argparse.Namespace, schema: str, queue: str, *, installed: bool, limited: bool) -> list[Any]:
    env = {
        **os.environ,
        "SCHEMA": schema,
        "QUEUE": queue,
        "INSTALLED": "1" if installed else "0",
        "LIMITED": "1" if limited else "0",
        "RATE": str(args.rate),
        "THREADS": str(args.threads),
        "POLL": str(args.poll_ms),
    }
    processes = [
        subprocess.Popen(
            [sys.executable, str(HERE), "--worker"], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for _ in range(args.workers)
    ]
    # Every process started (imports done, consumers running) before a job is sent: the figures
    # are of the fleet at work, not of four interpreters starting on the same cores.
    for process in processes:
        assert process.stdout is not None
        process.stdout.readline()
    return processes


def _stop(processes: list[Any]) -> None:
    for process in processes:
        if process.stdin is not None:
            process.stdin.close()
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


# -- the runs -----------------------------------------------------------------------------------------


def _prepare() -> str:
    schema = f"bench_flow_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
        migrate(conn, schema=schema)
        conn.execute(
            sql.SQL("CREATE TABLE {} (n int, pid int, at timestamptz NOT NULL DEFAULT clock_timestamp())").format(
                sql.Identifier(schema, "calls")
            )
        )
    return schema


def _drop(schema: str) -> None:
    with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def _send(schema: str, queue: str, jobs: int, *, limited: bool, rate: int) -> None:
    sender = _broker(schema, limited=limited, rate=rate)
    try:
        actor = _declare(sender, schema, queue, limited=limited)
        with sender.transaction():
            for n in range(jobs):
                actor.send(n)
    finally:
        sender.close()


def _times(schema: str) -> list[float]:
    with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
        rows = conn.execute(
            sql.SQL("SELECT extract(epoch FROM at)::float8 FROM {} ORDER BY at").format(sql.Identifier(schema, "calls"))
        ).fetchall()
    return [row[0] for row in rows]


def busiest_second(times: list[float]) -> int:
    """The most calls in any window of one second (a sliding window over sorted times)."""
    most, start = 0, 0
    for end, at in enumerate(times):
        while at - times[start] >= 1.0:
            start += 1
        most = max(most, end - start + 1)
    return most


def _keep_sending(schema: str, queue: str, args: argparse.Namespace, stop: threading.Event) -> None:
    """Send ``--send-rate`` jobs a second (in batches of a tenth of a second) until ``stop``."""
    sender = _broker(schema, limited=True, rate=args.rate)
    try:
        actor = _declare(sender, schema, queue, limited=True)
        batch, n, started = max(1, args.send_rate // 10), 0, time.monotonic()
        while not stop.is_set():
            with sender.transaction():
                for _ in range(batch):
                    actor.send(n)
                    n += 1
            stop.wait(max(0.0, started + n / args.send_rate - time.monotonic()))
    finally:
        sender.close()


def run_limited(args: argparse.Namespace) -> dict[str, Any]:
    schema, queue = _prepare(), f"flow_{uuid.uuid4().hex[:8]}"
    stop = threading.Event()
    try:
        processes = _start(args, schema, queue, installed=True, limited=True)
        sending = threading.Thread(target=_keep_sending, args=(schema, queue, args, stop), daemon=True)
        sending.start()
        try:
            deadline = time.monotonic() + args.seconds + 30
            while time.monotonic() < deadline:
                time.sleep(1)
                times = _times(schema)
                if times and times[-1] - times[0] >= args.seconds:
                    break
        finally:
            stop.set()
            sending.join(timeout=30)
            _stop(processes)
        times = _times(schema)
        window = [at for at in times if at < times[0] + args.seconds]
        peak = busiest_second(window)
        achieved = len(window) / args.seconds
        log(f"limited: {len(window)} calls in {args.seconds} s, peak {peak} in 1 s, {achieved:.1f}/s at {args.rate}/s")
        return {
            "limit_peak_ratio": round(peak / args.rate, 3),
            "limit_throughput_ratio": round(achieved / args.rate, 3),
            "limit_peak_per_s": peak,
            "limit_achieved_per_s": round(achieved, 2),
        }
    finally:
        _drop(schema)


def _drain(args: argparse.Namespace, *, installed: bool) -> float:
    schema, queue = _prepare(), f"flow_{uuid.uuid4().hex[:8]}"
    try:
        processes = _start(args, schema, queue, installed=installed, limited=False)
        started = time.monotonic()
        try:
            # One transaction: every job becomes visible to the ready workers at once.
            _send(schema, queue, args.unlimited_jobs, limited=False, rate=args.rate)
            count = sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema, "calls"))
            with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
                while (row := conn.execute(count).fetchone()) is not None and row[0] < args.unlimited_jobs:
                    time.sleep(0.05)
            # The rate from first to last call: process start-up is the same with or without.
            times = _times(schema)
            per_s = (len(times) - 1) / max(times[-1] - times[0], 1e-6)
        finally:
            _stop(processes)
        log(
            f"unlimited, middleware {'installed' if installed else 'absent'}: {per_s:.0f} jobs/s "
            f"({time.monotonic() - started:.1f} s with sending)"
        )
        return per_s
    finally:
        _drop(schema)


def run_unlimited(args: argparse.Namespace) -> dict[str, Any]:
    with_middleware, without = [], []
    for round_ in range(args.rounds):
        # Alternating which goes first, so neither always runs on a server still busy with the last.
        for installed in (False, True) if round_ % 2 == 0 else (True, False):
            (with_middleware if installed else without).append(_drain(args, installed=installed))
    best_with, best_without = max(with_middleware), max(without)
    hook_ns = hook_cost_ns()
    log(f"unlimited: the hooks cost {hook_ns:.0f} ns a job")
    return {
        "unlimited_ratio": round(best_with / best_without, 3),
        "unlimited_hook_ns": round(hook_ns),
        "unlimited_with_per_s": round(best_with),
        "unlimited_without_per_s": round(best_without),
    }


def hook_cost_ns() -> float:
    """What RateLimits' hooks cost a job of an actor without ``rate_limit``, in nanoseconds: the
    end-to-end ratio on a shared machine is mostly noise, this is the part the middleware adds."""
    from dramatiq.broker import MessageProxy
    from dramatiq.brokers.stub import StubBroker

    broker = StubBroker()
    limits = RateLimits([RateLimit("api", per_second=1)], database=DATABASE_URL)
    broker.add_middleware(limits)
    actor = dramatiq.actor(lambda n: None, actor_name="plain", broker=broker)
    message = MessageProxy(actor.message(1))
    rounds = 200_000
    started = time.perf_counter()
    for _ in range(rounds):
        limits.before_process_message(broker, message)
        limits.after_process_message(broker, message, result=None)
    cost = (time.perf_counter() - started) / rounds * 1e9
    broker.close()
    return cost


def run_order() -> dict[str, Any]:
    path = HERE.with_name("flow_order.py")
    if not path.exists():
        log("order: benchmarks/flow_order.py is not there; its figures are null")
        return {"order_violations": None, "ordered_ratio": None}
    spec = importlib.util.spec_from_file_location("flow_order_benchmark", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    figures: dict[str, Any] = module.measure_order()
    return {
        "order_violations": figures.get("order_violations"),
        "ordered_ratio": figures.get("ordered_ratio"),
        **{f"order_{key}": value for key, value in figures.items() if key not in ("order_violations", "ordered_ratio")},
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker_main()
        return
    result: dict[str, Any] = {
        "seconds": args.seconds,
        "rate": args.rate,
        "workers": args.workers,
        "threads": args.threads,
        "poll_ms": args.poll_ms,
    }
    result.update(run_limited(args))
    result.update(run_unlimited(args))
    result.update(run_order())
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
