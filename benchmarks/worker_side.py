"""Worker-side benchmark: the whole middleware list against plain Dramatiq, one middleware at a time, in one run.

    python benchmarks/worker_side.py [--n 1500] [--threads 8] [--rounds 3] [--prefix bench_worker_]
    python benchmarks/worker_side.py --scenarios plain,full --rounds 5     # just the headline pair
    python benchmarks/worker_side.py --py-spy /tmp/profiles                # a py-spy profile per worker

Every scenario drains a backlog of ``--n`` messages, published straight to RabbitMQ before the
worker starts (not through the outbox, so only the worker side is measured), with the same
one-INSERT actor: one business row per message, committed.  The worker runs in a process of its
own (``--threads`` threads, Dramatiq's default 8), as in production; the rate is taken from the
business rows' own timestamps, ``(n - 1) / (last row - first row)``, so the worker's start-up
and shutdown are not in it.  Scenarios, each adding one middleware to the one before (the order
is docs/middleware-order.md's), interleaved round by round so machine noise hits them alike:

  plain         plain Dramatiq: ``RabbitmqBroker`` with its default middleware; the actor
                borrows a pooled connection and commits its INSERT in a transaction
  plain_key     the ceiling, no middleware of ours: plain Dramatiq whose actor runs the
                idempotency claim itself before its INSERT (the statements a durable key
                needs, and nothing else)
  retries       ``OutboxBroker`` + ``ClassifiedRetries`` in place of Dramatiq's ``Retries`` (the
                broker adds its own small tracking middleware); the actor opens
                ``broker.transaction()``
  idempotency   + ``Idempotency`` (transactional): the actor writes on ``job_connection()``,
                so the key commits with its row
  dead_letters  + ``DeadLetters``
  tracing       + ``Tracing`` first in the list, with the no-op providers (no SDK configured)
  full          + ``WorkerRelay`` (a relay thread in the worker, idle: the outbox is empty)

Where the time goes: between the first and the last poll of the business table, the CPU time
the worker process and its own Postgres backends (found by ``application_name``) used, per job
(``cpu_us_per_job``, medians; read from ``/proc``, so Linux only, and left out under ``--py-spy``).

The last line printed is one JSON object: ``worker_ratio`` (full / plain, the medians' ratio),
``worker_ratio_paired`` (the median of each round's full / plain) and ``worker_ratio_spread``
(those rounds' [min, max]; ``ceiling_ratio_spread`` likewise), ``ceiling_ratio``
(plain_key / plain: what any middleware keeping the key in the job's transaction could reach
here), ``ratios`` (each scenario / plain), ``step_ratios`` (each scenario of the chain / the one
before it, what that middleware costs), the median rates (jobs/s), every round's rates and
``cpu_us_per_job``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.message import Message
from psycopg import sql

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
RABBITMQ_URL = os.environ.get("RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
SCENARIOS = ("plain", "plain_key", "retries", "idempotency", "dead_letters", "tracing", "full")
# Each of these adds one middleware to the one before it.
CHAIN = ("plain", "retries", "idempotency", "dead_letters", "tracing", "full")
ACTOR = "worker_side_effect"


def log(text: str) -> None:
    print(text, flush=True)


# -- the worker process -------------------------------------------------------------------------


def build_worker(scenario: str, *, url: str, schema: str, queue: str, pool_size: int) -> tuple[Any, Callable[[], None]]:
    """The broker of ``scenario`` with the one-INSERT actor declared on it, and a cleanup."""
    import dramatiq
    from dramatiq.middleware import AgeLimit, Middleware, ShutdownNotifications, TimeLimit

    from dramatiq_reliable import (
        ClassifiedRetries,
        Database,
        DeadLetters,
        Idempotency,
        OutboxBroker,
        Tracing,
        WorkerRelay,
        _sql,
        build_middleware,
        job_connection,
    )
    from dramatiq_reliable.idempotency import payload_hash

    insert = sql.SQL("INSERT INTO {} (n) VALUES (%s)").format(sql.Identifier(schema, "business"))
    fn: Callable[[int], None]
    if scenario in ("plain", "plain_key"):
        broker: Any = RabbitmqBroker(url=RABBITMQ_URL)
        database = Database(url=url, max_size=pool_size)
        claim = _sql.rendered("idempotency_claim", schema)
        with_key = scenario == "plain_key"

        def fn(i: int) -> None:
            with database.connection() as conn, conn.transaction():
                if with_key:
                    key = str(uuid.uuid4())  # random, as the message ids the middleware uses are
                    params = {
                        "actor_name": ACTOR,
                        "job_key": key,
                        "payload_hash": payload_hash((i,), {}),
                        "message_id": key,
                        "retention_s": 604_800.0,
                    }
                    conn.execute(claim, params).fetchone()
                conn.execute(insert, (i,))

        dramatiq.actor(fn, actor_name=ACTOR, queue_name=queue, broker=broker)
        return broker, database.close

    level = CHAIN.index(scenario)
    listed: list[Middleware] = [AgeLimit(), TimeLimit(), ShutdownNotifications()]
    if level >= CHAIN.index("tracing"):
        listed.insert(0, Tracing())
    if level >= CHAIN.index("idempotency"):
        listed.append(Idempotency())
    if level >= CHAIN.index("dead_letters"):
        listed.append(DeadLetters())
    if level >= CHAIN.index("full"):
        listed.append(WorkerRelay())
    broker = OutboxBroker(
        url=RABBITMQ_URL,
        database=url,
        schema=schema,
        pool_max_size=pool_size,
        middleware=build_middleware(middleware=listed, retries=ClassifiedRetries()),
    )
    if level >= CHAIN.index("idempotency"):

        def fn(i: int) -> None:
            job_connection().execute(insert, (i,))

    else:

        def fn(i: int) -> None:
            with broker.transaction() as conn:
                conn.execute(insert, (i,))

    dramatiq.actor(fn, actor_name=ACTOR, queue_name=queue, broker=broker)

    def close() -> None:
        for item in broker.middleware:
            if isinstance(item, Tracing):
                item.close()

    return broker, close


def serve(args: argparse.Namespace) -> None:
    """Run one scenario's worker until the parent closes our stdin."""
    import dramatiq

    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("pika").setLevel(logging.CRITICAL)
    url = psycopg.conninfo.make_conninfo(DATABASE_URL, application_name=args.queue)
    broker, cleanup = build_worker(
        args.worker, url=url, schema=args.schema, queue=args.queue, pool_size=args.threads + 2
    )
    worker = dramatiq.Worker(broker, worker_threads=args.threads, worker_timeout=100)
    worker.start()
    try:
        sys.stdin.read()  # EOF: the parent saw every row
    finally:
        worker.stop()
        broker.close()
        cleanup()


# -- the parent ---------------------------------------------------------------------------------


def prefill(queue: str, n: int) -> None:
    """Publish ``n`` messages straight to RabbitMQ (no outbox, no middleware)."""
    publisher = RabbitmqBroker(url=RABBITMQ_URL, middleware=[])
    try:
        publisher.declare_queue(queue, ensure=True)
        for i in range(n):
            publisher.enqueue(Message(queue_name=queue, actor_name=ACTOR, args=(i,), kwargs={}, options={}))
    finally:
        publisher.close()


def delete_queue(queue: str) -> None:
    cleaner = RabbitmqBroker(url=RABBITMQ_URL, middleware=[])
    try:
        for name in (queue, f"{queue}.DQ", f"{queue}.XQ"):
            cleaner.channel.queue_delete(name)
    finally:
        cleaner.close()


def reset(conn: psycopg.Connection[Any], schema: str) -> None:
    conn.execute(
        sql.SQL("TRUNCATE {}, {}").format(sql.Identifier(schema, "business"), sql.Identifier(schema, "processed_jobs"))
    )
    conn.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(schema, "processed_jobs")))


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process so far (Linux ``/proc``), ``None`` if unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_snapshot(conn: psycopg.Connection[Any], worker_pid: int | None, application_name: str) -> dict[str, float]:
    """CPU seconds used so far by the worker process and by its Postgres backends."""
    if worker_pid is None:
        return {}
    worker = cpu_seconds(worker_pid)
    rows = conn.execute("SELECT pid FROM pg_stat_activity WHERE application_name = %s", (application_name,))
    backends = [cpu_seconds(int(pid)) for (pid,) in rows.fetchall()]
    if worker is None or not backends or None in backends:
        return {}
    return {"worker": worker, "postgres": sum(b for b in backends if b is not None)}


def drain(
    conn: psycopg.Connection[Any], schema: str, n: int, timeout_s: float, worker_pid: int | None, queue: str
) -> tuple[float, dict[str, float]]:
    """Wait for ``n`` business rows: jobs/s between the first and the last, and CPU µs per job."""
    table = sql.Identifier(schema, "business")
    count = sql.SQL("SELECT count(*) FROM {}").format(table)
    deadline = time.monotonic() + timeout_s
    first: tuple[int, dict[str, float]] | None = None
    while True:
        row = conn.execute(count).fetchone()
        done = int(row[0]) if row else 0
        if done > 0 and first is None:
            first = (done, cpu_snapshot(conn, worker_pid, queue))
        if done >= n:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {done} of {n} jobs done in {timeout_s:.0f} s")
        time.sleep(0.1)
    last = cpu_snapshot(conn, worker_pid, queue)
    cpu: dict[str, float] = {}
    if first is not None and first[1] and last and done > first[0]:
        cpu = {key: (last[key] - first[1][key]) * 1e6 / (done - first[0]) for key in last}
    span = conn.execute(sql.SQL("SELECT extract(epoch FROM max(at) - min(at)) FROM {}").format(table)).fetchone()
    seconds = float(span[0]) if span and span[0] is not None else 0.0
    return ((n - 1) / seconds if seconds > 0 else float("inf")), cpu


def run_scenario(
    scenario: str, conn: psycopg.Connection[Any], *, schema: str, n: int, threads: int, profile: str | None, tag: str
) -> tuple[float, dict[str, float]]:
    queue = f"{schema}_{scenario}"
    reset(conn, schema)
    prefill(queue, n)
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        scenario,
        "--schema",
        schema,
        "--queue",
        queue,
        "--threads",
        str(threads),
    ]
    if profile is not None:
        spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
        out = os.path.join(profile, f"{scenario}-{tag}.txt")
        command = [spy, "record", "--gil", "-r", "250", "-f", "raw", "-o", out, "--", *command]
    worker = subprocess.Popen(command, stdin=subprocess.PIPE)
    try:
        pid = None if profile is not None else worker.pid
        return drain(conn, schema, n, max(120.0, n / 20), pid, queue)
    finally:
        assert worker.stdin is not None
        worker.stdin.close()
        try:
            worker.wait(timeout=60)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
        delete_queue(queue)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--n", type=int, default=int(os.environ.get("WORKER_BENCH_N", "1500")))
    parser.add_argument("--threads", type=int, default=8, help="worker threads (Dramatiq's default: 8)")
    parser.add_argument("--rounds", type=int, default=int(os.environ.get("WORKER_BENCH_ROUNDS", "3")))
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated, from " + ",".join(SCENARIOS))
    parser.add_argument("--prefix", default="bench_worker_", help="schema and queue name prefix")
    parser.add_argument("--py-spy", dest="py_spy", metavar="DIR", help="record each worker with py-spy into DIR")
    # the worker process
    parser.add_argument("--worker", choices=SCENARIOS, help=argparse.SUPPRESS)
    parser.add_argument("--schema", help=argparse.SUPPRESS)
    parser.add_argument("--queue", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        serve(args)
        return
    scenarios = [name.strip() for name in args.scenarios.split(",") if name.strip()]
    unknown = sorted(set(scenarios) - set(SCENARIOS))
    if unknown or "plain" not in scenarios:
        parser.error(
            f"--scenarios must include plain and name only {', '.join(SCENARIOS)} (got {unknown or scenarios})"
        )
    scenarios.sort(key=SCENARIOS.index)
    if args.py_spy:
        os.makedirs(args.py_spy, exist_ok=True)

    from dramatiq_reliable import migrate

    schema = f"{args.prefix}{uuid.uuid4().hex[:8]}"
    migrate(DATABASE_URL, schema=schema)
    rates: dict[str, list[float]] = {name: [] for name in scenarios}
    cpu: dict[str, dict[str, list[float]]] = {name: {} for name in scenarios}
    log(f"n={args.n} threads={args.threads} rounds={args.rounds} cpus={os.cpu_count()} schema={schema}")
    with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
        try:
            conn.execute(
                sql.SQL("CREATE TABLE {} (n int NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())").format(
                    sql.Identifier(schema, "business")
                )
            )
            for round_number in range(1, args.rounds + 1):
                for scenario in scenarios:
                    rate, used = run_scenario(
                        scenario,
                        conn,
                        schema=schema,
                        n=args.n,
                        threads=args.threads,
                        profile=args.py_spy,
                        tag=str(round_number),
                    )
                    rates[scenario].append(rate)
                    for key, value in used.items():
                        cpu[scenario].setdefault(key, []).append(value)
                    shown = "  ".join(f"{key} {value:5.0f} µs" for key, value in used.items())
                    log(f"round {round_number} {scenario:<13} {rate:8.0f} jobs/s   cpu per job: {shown}")
        finally:
            with contextlib.suppress(psycopg.Error):
                conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))

    median = {name: statistics.median(values) for name, values in rates.items()}
    ratios = {name: round(median[name] / median["plain"], 3) for name in scenarios}
    # Each round's scenarios ran back to back: their ratio to that round's plain is the fairer
    # sample on a shared machine, and the rounds' min and max show how far to trust the median.
    paired = {
        name: [rate / plain for rate, plain in zip(rates[name], rates["plain"], strict=True)] for name in scenarios
    }

    def spread(name: str) -> list[float] | None:
        return [round(min(paired[name]), 3), round(max(paired[name]), 3)] if name in paired else None

    def paired_median(name: str) -> float | None:
        return round(statistics.median(paired[name]), 3) if name in paired else None

    chain = [name for name in scenarios if name in CHAIN]
    steps = {later: round(median[later] / median[earlier], 3) for earlier, later in itertools.pairwise(chain)}
    results: dict[str, Any] = {
        "n": args.n,
        "threads": args.threads,
        "rounds": args.rounds,
        "worker_ratio": ratios.get("full"),
        "worker_ratio_paired": paired_median("full"),
        "worker_ratio_spread": spread("full"),
        "ceiling_ratio": ratios.get("plain_key"),
        "ceiling_ratio_spread": spread("plain_key"),
        "ratios": ratios,
        "step_ratios": steps,
        "rates": {name: round(value, 1) for name, value in median.items()},
        "round_rates": {name: [round(v, 1) for v in values] for name, values in rates.items()},
        "cpu_us_per_job": {
            name: {key: round(statistics.median(values)) for key, values in used.items()} for name, used in cpu.items()
        },
    }
    log(json.dumps(results))


if __name__ == "__main__":
    main()
