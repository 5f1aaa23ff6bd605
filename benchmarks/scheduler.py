"""Scheduler and singleton benchmark: how fast due ticks reach the outbox, and what a lease costs.

    python benchmarks/scheduler.py [--schedules 10000] [--messages 2000]

1. ``--schedules`` schedules (every 20 s) are all due at the same second F.  One, then three scheduler loops
   (the library's ``Scheduler``, each in a process of its own so the GIL is not what is measured)
   claim and fire them; each run in a fresh schema.  Reported: ticks/s (schedules / seconds from
   F to the last loop done) and the lag from F to the tick's outbox row ``created_at`` (p50/p99;
   ``created_at`` is the firing transaction's start).  Every tick must reach the outbox exactly once.
2. One actor doing one INSERT, run ``--messages`` times by a one-thread worker on a StubBroker,
   with ``singleton=True`` under the ``Singleton`` middleware and, in the same run, as a plain
   actor; ``singleton_ratio`` is singleton throughput / plain throughput (1.0 = free).

Each part uses its own schema, dropped at the end.  The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import statistics
import threading
import time
import uuid
from typing import Any

import dramatiq
import psycopg
from dramatiq.brokers.stub import StubBroker
from psycopg import sql

from dramatiq_reliable import Database, Singleton, migrate
from dramatiq_reliable.scheduler import Registry, Schedule, Scheduler

# Long enough that the tick after F is not due before every loop is done, short enough to wait for.
_INTERVAL_S = 20
DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")


def log(text: str) -> None:
    print(text, flush=True)


def _schema() -> str:
    return f"bench_sched_{uuid.uuid4().hex[:8]}"


def _drop(schema: str) -> None:
    with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, int(len(ordered) * fraction) - 1)]


# -- part 1: scheduler loops --------------------------------------------------------------------


def _loop(schema: str, start_at: float, done: Any) -> None:
    """One scheduler process: warm up, wait for F, then fire until nothing is left to claim."""
    scheduler = Scheduler(database=Database(url=DATABASE_URL, max_size=2), schema=schema, registry=Registry())
    scheduler.tick_once()  # opens the pool and checks the schema; nothing is due yet
    time.sleep(max(0.0, start_at - time.time()))
    empty = 0
    while empty < 2:
        empty = empty + 1 if scheduler.tick_once().claimed == 0 else 0
    done.put(time.time())
    scheduler.close()


def bench_loops(schedules: int, loops: int) -> dict[str, float]:
    schema = _schema()
    try:
        migrate(DATABASE_URL, schema=schema)
        registry = Registry()
        for n in range(schedules):
            registry.add(
                Schedule(name=f"s{n}", actor_name="tick", queue_name="bench", every_ms=int(_INTERVAL_S * 1000))
            )
        Scheduler(database=DATABASE_URL, schema=schema, registry=registry).sync()
        with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
            row = conn.execute("SELECT extract(epoch FROM clock_timestamp())").fetchone()
            # Interval ticks fall on multiples of the interval: F is the first one at least 2 s away.
            fire_at = float(math.ceil((float(row[0]) + 2) / _INTERVAL_S) * _INTERVAL_S)  # type: ignore[index]
            conn.execute(
                sql.SQL("UPDATE {} SET next_fire_at = to_timestamp(%s)").format(sql.Identifier(schema, "schedules")),
                (fire_at,),
            )
        context = multiprocessing.get_context("spawn")
        done = context.Queue()
        processes = [context.Process(target=_loop, args=(schema, fire_at, done)) for _ in range(loops)]
        for process in processes:
            process.start()
        finished = [done.get(timeout=600) for _ in processes]
        for process in processes:
            process.join()
        with psycopg.connect(DATABASE_URL) as conn:
            lags = [
                float(r[0]) * 1000
                for r in conn.execute(
                    sql.SQL("SELECT extract(epoch FROM created_at) - %s FROM {}").format(
                        sql.Identifier(schema, "outbox")
                    ),
                    (fire_at,),
                ).fetchall()
            ]
            distinct = conn.execute(
                sql.SQL("SELECT count(DISTINCT message_id) FROM {}").format(sql.Identifier(schema, "outbox"))
            ).fetchone()
        if len(lags) != schedules or distinct is None or distinct[0] != schedules:
            raise SystemExit(f"{loops} loop(s) wrote {len(lags)} outbox rows for {schedules} ticks: not exactly once")
        elapsed = max(finished) - fire_at
        return {
            "ticks_per_s": round(schedules / elapsed, 1),
            "lag_p50_ms": round(statistics.median(lags), 1),
            "lag_p99_ms": round(_percentile(lags, 0.99), 1),
            # created_at is the firing transaction's start: this is when the last tick was committed
            "all_fired_ms": round(elapsed * 1000, 1),
        }
    finally:
        _drop(schema)


# -- part 2: singleton overhead -----------------------------------------------------------------


def bench_singleton(messages: int) -> dict[str, float]:
    schema = _schema()
    try:
        migrate(DATABASE_URL, schema=schema)
        with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE TABLE {} (n int)").format(sql.Identifier(schema, "effects")))
        insert = sql.SQL("INSERT INTO {} (n) VALUES (%s)").format(sql.Identifier(schema, "effects"))
        local = threading.local()

        def effect(n: int) -> None:
            conn = getattr(local, "conn", None)
            if conn is None:
                conn = local.conn = psycopg.connect(DATABASE_URL, autocommit=True)
            conn.execute(insert, (n,))

        broker = StubBroker()
        broker.add_middleware(Singleton(database=DATABASE_URL, schema=schema))
        plain = dramatiq.actor(effect, actor_name="plain", queue_name="plain", broker=broker)
        single = dramatiq.actor(effect, actor_name="single", queue_name="single", broker=broker, singleton=True)
        worker = dramatiq.Worker(broker, worker_threads=1, worker_timeout=10)
        worker.start()
        rates: dict[str, list[float]] = {"plain": [], "single": []}
        try:
            for _ in range(3):  # interleaved rounds: both sides see the same machine load
                for name, actor in (("plain", plain), ("single", single)):
                    for n in range(messages):
                        actor.send(n)
                    started = time.perf_counter()
                    broker.join(actor.queue_name, fail_fast=True)
                    worker.join()
                    rates[name].append(messages / (time.perf_counter() - started))
        finally:
            worker.stop()
            broker.close()
        plain_rate, single_rate = statistics.median(rates["plain"]), statistics.median(rates["single"])
        return {
            "plain_per_s": round(plain_rate, 1),
            "singleton_per_s": round(single_rate, 1),
            "singleton_ratio": round(single_rate / plain_rate, 3),
        }
    finally:
        _drop(schema)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", type=int, default=10_000)
    parser.add_argument("--messages", type=int, default=2_000)
    args = parser.parse_args()
    one = bench_loops(args.schedules, 1)
    log(f"1 scheduler loop:   {one}")
    three = bench_loops(args.schedules, 3)
    log(f"3 scheduler loops:  {three}")
    single = bench_singleton(args.messages)
    log(f"singleton actor vs plain (1 worker thread, {args.messages} messages): {single}")
    result = {
        "schedules": args.schedules,
        "ticks_per_s_1": one["ticks_per_s"],
        "ticks_per_s_3": three["ticks_per_s"],
        "ticks_ratio_3_to_1": round(three["ticks_per_s"] / one["ticks_per_s"], 3),
        "lag_p50_ms_1": one["lag_p50_ms"],
        "lag_p99_ms_1": one["lag_p99_ms"],
        "lag_p50_ms": three["lag_p50_ms"],
        "lag_p99_ms": three["lag_p99_ms"],
        "all_fired_ms_1": one["all_fired_ms"],
        "all_fired_ms_3": three["all_fired_ms"],
        **single,
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
