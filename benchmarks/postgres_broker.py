"""PostgresBroker benchmark against the Postgres job queues it competes with, in one run on one server.

    pip install -e '.[bench]'
    python benchmarks/postgres_broker.py [--jobs 5000] [--latency-seconds 10] [--backlog 0]

For each system (ours, dramatiq-postgres, PgQueuer, Procrastinate), on the same server and
each in a schema of its own (dropped afterwards):
  1. enqueue ``--jobs`` jobs one call each, each committed on its own (ours: ``send()`` inside
     ``broker.transaction()``, the caller's transaction);
  2. drain them with 8 worker threads (or 8 concurrent tasks), the job doing one INSERT;
  enqueue-to-done is the two together (jobs / total seconds).
Then, ours only: latency from commit to the job's INSERT at a steady 200 jobs/s (p50/p99), and
with ``--backlog N`` (e.g. 1000000) the drain rate of the first jobs with N rows waiting, which
shows whether the claim stays fast with a large backlog (a separate mode: loading 1M rows takes
a while).  A peer that is not installed is skipped and named.  The last line printed is one JSON
object with the figures and ``drain_ratio_to_best_peer``, ``enqueue_to_done_ratio_to_best_peer``
and ``latency_p99_ms``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import dramatiq
import psycopg
from psycopg import sql

from dramatiq_reliable import PostgresBroker, migrate

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
THREADS = 8


def log(text: str) -> None:
    print(text, flush=True)


def _schema() -> str:
    return f"bench_{uuid.uuid4().hex[:8]}"


def _drop(schema: str) -> None:
    with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def _effects(schema: str) -> None:
    with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
        conn.execute(
            sql.SQL("CREATE TABLE {} (n int, at timestamptz DEFAULT clock_timestamp())").format(
                sql.Identifier(schema, "effects")
            )
        )


def _count(schema: str) -> int:
    with psycopg.connect(DATABASE_URL) as conn:
        row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema, "effects"))).fetchone()
        return int(row[0]) if row else 0


def _wait_count(schema: str, expected: int, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while _count(schema) < expected:
        if time.monotonic() > deadline:
            raise SystemExit(f"benchmark timed out waiting for {expected} jobs in {schema}")
        time.sleep(0.02)


class _Inserter:
    """The job's one INSERT, on a connection per thread (the same for every system)."""

    def __init__(self, schema: str) -> None:
        self.query = sql.SQL("INSERT INTO {} (n) VALUES (%s)").format(sql.Identifier(schema, "effects"))
        self.local = threading.local()

    def __call__(self, n: int) -> None:
        conn = getattr(self.local, "conn", None)
        if conn is None:
            conn = self.local.conn = psycopg.connect(DATABASE_URL, autocommit=True)
        conn.execute(self.query, (n,))


# -- ours ---------------------------------------------------------------------------------------


def bench_ours(jobs: int) -> dict[str, float]:
    schema = _schema()
    try:
        migrate(DATABASE_URL, schema=schema)
        _effects(schema)
        broker = PostgresBroker(database=DATABASE_URL, schema=schema, pool_max_size=THREADS + 6)
        insert = _Inserter(schema)
        actor = dramatiq.actor(insert, actor_name="bench_job", queue_name="bench", broker=broker)
        started = time.perf_counter()
        for n in range(jobs):
            with broker.transaction():
                actor.send(n)
        enqueued = time.perf_counter()
        worker = dramatiq.Worker(broker, worker_threads=THREADS, worker_timeout=100)
        worker.start()
        _wait_count(schema, jobs)
        done = time.perf_counter()
        worker.stop()
        broker.close()
        return _rates(jobs, started, enqueued, done)
    finally:
        _drop(schema)


def latency_ours(seconds: float, rate: int = 200) -> dict[str, float]:
    schema = _schema()
    try:
        migrate(DATABASE_URL, schema=schema)
        _effects(schema)
        broker = PostgresBroker(database=DATABASE_URL, schema=schema, pool_max_size=THREADS + 6)
        insert = _Inserter(schema)
        actor = dramatiq.actor(insert, actor_name="bench_job", queue_name="bench", broker=broker)
        worker = dramatiq.Worker(broker, worker_threads=THREADS, worker_timeout=1000)
        worker.start()
        time.sleep(0.5)  # the listener connects
        committed: dict[int, float] = {}
        total = int(seconds * rate)
        start = time.monotonic()
        with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
            offset = conn.execute("SELECT extract(epoch FROM clock_timestamp())").fetchone()[0]
            offset = float(offset) - time.time()
        for n in range(total):
            target = start + n / rate
            pause = target - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            with broker.transaction():
                actor.send(n)
            committed[n] = time.time() + offset
        _wait_count(schema, total)
        worker.stop()
        broker.close()
        with psycopg.connect(DATABASE_URL) as conn:
            rows = conn.execute(
                sql.SQL("SELECT n, extract(epoch FROM at) FROM {}").format(sql.Identifier(schema, "effects"))
            ).fetchall()
        latencies = sorted((float(at) - committed[n]) * 1000 for n, at in rows)
        return {
            "latency_p50_ms": round(statistics.median(latencies), 2),
            "latency_p99_ms": round(latencies[int(len(latencies) * 0.99) - 1], 2),
        }
    finally:
        _drop(schema)


def backlog_ours(backlog: int, sample: int = 20_000) -> dict[str, float]:
    """Drain rate of the first ``sample`` jobs with ``backlog`` rows waiting."""
    schema = _schema()
    try:
        migrate(DATABASE_URL, schema=schema)
        _effects(schema)
        broker = PostgresBroker(database=DATABASE_URL, schema=schema, pool_max_size=THREADS + 6)
        insert = _Inserter(schema)
        actor = dramatiq.actor(insert, actor_name="bench_job", queue_name="bench", broker=broker)
        body = actor.message(0).encode()
        log(f"loading {backlog:,} waiting rows ...")
        with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
            conn.execute(
                sql.SQL(
                    "INSERT INTO {} (queue_name, message_id, actor_name, body) "
                    "SELECT 'bench', gen_random_uuid()::text, 'bench_job', %s FROM generate_series(1, %s)"
                ).format(sql.Identifier(schema, "queue")),
                (body, backlog),
            )
            conn.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(schema, "queue")))
        worker = dramatiq.Worker(broker, worker_threads=THREADS, worker_timeout=100)
        started = time.perf_counter()
        worker.start()
        _wait_count(schema, sample)
        elapsed = time.perf_counter() - started
        worker.stop()
        broker.close()
        return {"backlog_rows": backlog, "backlog_drain_per_s": round(sample / elapsed, 1)}
    finally:
        _drop(schema)


def _rates(jobs: int, started: float, enqueued: float, done: float) -> dict[str, float]:
    return {
        "enqueue_per_s": round(jobs / (enqueued - started), 1),
        "drain_per_s": round(jobs / (done - enqueued), 1),
        "enqueue_to_done_per_s": round(jobs / (done - started), 1),
    }


# -- peers --------------------------------------------------------------------------------------


def bench_dramatiq_postgres(jobs: int) -> dict[str, float]:
    import dramatiq_postgres

    schema = _schema()
    try:
        _effects(schema)
        with psycopg.connect(DATABASE_URL) as conn, conn.cursor() as cursor:
            dramatiq_postgres.init(cursor, schema=schema)
            conn.commit()
        broker = dramatiq_postgres.PostgresBroker(url=DATABASE_URL, schema=schema, results=False)
        insert = _Inserter(schema)
        actor = dramatiq.actor(insert, actor_name="bench_job", queue_name="bench", broker=broker)
        started = time.perf_counter()
        for n in range(jobs):
            actor.send(n)
        enqueued = time.perf_counter()
        worker = dramatiq.Worker(broker, worker_threads=THREADS, worker_timeout=100)
        worker.start()
        _wait_count(schema, jobs)
        done = time.perf_counter()
        worker.stop()
        broker.close()
        return _rates(jobs, started, enqueued, done)
    finally:
        _drop(schema)


def _search_path(schema: str) -> str:
    return f"-c search_path={schema}"


def bench_pgqueuer(jobs: int) -> dict[str, float]:
    from pgqueuer import PgQueuer, PsycopgDriver, Queries
    from pgqueuer.domain.types import QueueExecutionMode

    schema = _schema()
    _effects(schema)
    insert_sql = sql.SQL("INSERT INTO {} (n) VALUES (%s)").format(sql.Identifier(schema, "effects"))

    async def main() -> dict[str, float]:
        conn = await psycopg.AsyncConnection.connect(DATABASE_URL, autocommit=True, options=_search_path(schema))
        queries = Queries(PsycopgDriver(conn))
        await queries.install(create_schema=False)
        started = time.perf_counter()
        for n in range(jobs):
            await queries.enqueue("bench_job", str(n).encode())
        enqueued = time.perf_counter()
        worker_conn = await psycopg.AsyncConnection.connect(DATABASE_URL, autocommit=True, options=_search_path(schema))
        pgq = PgQueuer(PsycopgDriver(worker_conn))
        effects = await psycopg.AsyncConnection.connect(DATABASE_URL, autocommit=True)
        lock = asyncio.Lock()

        @pgq.entrypoint("bench_job")
        async def bench_job(job: Any) -> None:
            async with lock:  # one connection for the effects: an INSERT at a time
                await effects.execute(insert_sql, (int(job.payload),))

        await pgq.run(
            # Large batches: PgQueuer waits 100 ms between dequeues while work remains, so its
            # default of 10 a batch caps it near 100 jobs/s; 100 is its best setting here.
            batch_size=100,
            mode=QueueExecutionMode.drain,
            max_concurrent_tasks=200,
            dequeue_timeout=timedelta(milliseconds=100),
        )
        done = time.perf_counter()
        for c in (conn, worker_conn, effects):
            await c.close()
        return _rates(jobs, started, enqueued, done)

    try:
        result = asyncio.run(main())
        if _count(schema) != jobs:
            raise SystemExit(f"pgqueuer ran {_count(schema)} of {jobs} jobs")
        return result
    finally:
        _drop(schema)


def bench_procrastinate(jobs: int) -> dict[str, float]:
    import procrastinate

    schema = _schema()
    _effects(schema)
    insert_sql = sql.SQL("INSERT INTO {} (n) VALUES (%s)").format(sql.Identifier(schema, "effects"))

    async def main() -> dict[str, float]:
        app = procrastinate.App(
            connector=procrastinate.PsycopgConnector(conninfo=DATABASE_URL, kwargs={"options": _search_path(schema)})
        )
        effects = await psycopg.AsyncConnection.connect(DATABASE_URL, autocommit=True)
        lock = asyncio.Lock()

        @app.task(name="bench_job", queue="bench")
        async def bench_job(n: int) -> None:
            async with lock:
                await effects.execute(insert_sql, (n,))

        async with app.open_async():
            await app.schema_manager.apply_schema_async()
            started = time.perf_counter()
            for n in range(jobs):
                await bench_job.defer_async(n=n)
            enqueued = time.perf_counter()
            await app.run_worker_async(queues=["bench"], concurrency=THREADS, wait=False)
            done = time.perf_counter()
        await effects.close()
        return _rates(jobs, started, enqueued, done)

    try:
        result = asyncio.run(main())
        if _count(schema) != jobs:
            raise SystemExit(f"procrastinate ran {_count(schema)} of {jobs} jobs")
        return result
    finally:
        _drop(schema)


PEERS: dict[str, Callable[[int], dict[str, float]]] = {
    "dramatiq_postgres": bench_dramatiq_postgres,
    "pgqueuer": bench_pgqueuer,
    "procrastinate": bench_procrastinate,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--jobs", type=int, default=5000)
    parser.add_argument("--latency-seconds", type=float, default=10.0)
    parser.add_argument("--backlog", type=int, default=0, help="also drain with this many rows waiting (e.g. 1000000)")
    args = parser.parse_args()
    result: dict[str, Any] = {"jobs": args.jobs, "threads": THREADS}
    result["ours"] = ours = bench_ours(args.jobs)
    log(f"ours: {ours}")
    peers: dict[str, dict[str, float]] = {}
    for name, bench in PEERS.items():
        try:
            peers[name] = bench(args.jobs)
        except ImportError as error:
            log(f"{name}: skipped, not installed ({error}); pip install -e '.[bench]'")
            continue
        log(f"{name}: {peers[name]}")
    result["peers"] = peers
    result.update(latency_ours(args.latency_seconds))
    if args.backlog:
        result.update(backlog_ours(args.backlog))
    if peers:
        best_drain = max(p["drain_per_s"] for p in peers.values())
        best_e2d = max(p["enqueue_to_done_per_s"] for p in peers.values())
        result["drain_ratio_to_best_peer"] = round(ours["drain_per_s"] / best_drain, 2)
        result["enqueue_to_done_ratio_to_best_peer"] = round(ours["enqueue_to_done_per_s"] / best_e2d, 2)
    else:
        result["drain_ratio_to_best_peer"] = None
        result["enqueue_to_done_ratio_to_best_peer"] = None
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
