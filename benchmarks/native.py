"""Native sends: ``await send_async(...)`` against sync ``send()``, and Django's view sending in ``atomic()``.

    python benchmarks/native.py [--rounds 5] [--sends 1000] [--batch 50] [--broker outbox|queue] [--no-django]

On one broker (``OutboxBroker`` by default; its sends need no RabbitMQ) and one run, two ways
of sending, each sync and async, in rounds whose order rotates so machine noise hits them alike:
  1. transaction: ``--batch`` sends per transaction (``with broker.transaction():`` and
     ``async with broker.transaction():``), ``--sends`` sends in all;
  2. autocommit: ``--sends`` sends with nothing bound, each committed on its own on a pooled
     connection (the sync pool, and the broker's async pool).
The async sends run one after another on one event loop (the pool is that loop's, opened
before timing), so the figure is the cost of the async path, not of concurrency.  Each round
runs the ways (and psycopg alone, sync and async) in slices of ``--batch`` sends that alternate (rotating order), so load from
elsewhere on the machine lands on all of them alike.  Rates are medians over rounds, ratios
the median of each round's async/sync ratio.

``django_send_ratio`` comes from ``benchmarks/native_django.py``'s ``measure_django()`` (a Django
view sending inside ``atomic()`` against the same view writing only its row); ``null`` with a
note when that module or Django is missing, or with ``--no-django``.

The last line printed is one JSON object: ``send_async_ratio_transaction``,
``send_async_ratio_autocommit``, ``send_async_ratio`` (the lower of the two; target >= 0.9),
the sends/s of each way, ``psycopg_async_ratio`` (psycopg's own ``await conn.execute`` against
``conn.execute`` for a one-row INSERT, no code of ours, measured in the same slices: the
driver's part of the gap) and ``django_send_ratio``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dramatiq
import psycopg
from psycopg import sql

from dramatiq_reliable import OutboxBroker, PostgresBroker, migrate, send_async

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
RABBITMQ_URL = os.environ.get("RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
BROKERS = ("outbox", "queue")
WAYS = ("sync_transaction", "async_transaction", "sync_autocommit", "async_autocommit", "psycopg_sync", "psycopg_async")
#: psycopg alone: the same one-row INSERT with ``conn.execute`` and ``await conn.execute``, no code of ours.
FLOOR_INSERT = "INSERT INTO native_floor VALUES (%s)"


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="rotating rounds (default 5)")
    parser.add_argument("--sends", type=int, default=1000, help="sends per way and round (default 1000)")
    parser.add_argument("--batch", type=int, default=50, help="sends per transaction (default 50)")
    parser.add_argument("--broker", choices=BROKERS, default="outbox", help="outbox (default) or queue")
    parser.add_argument("--no-django", action="store_true", help="skip native_django.measure_django()")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.sends < 1 or not 1 <= args.batch <= args.sends:
        parser.error("--rounds and --sends must be >= 1 and --batch between 1 and --sends")
    return args


class Sends:
    """The ways of sending, one slice at a time; each returns the seconds its sends took.

    ``psycopg_sync`` and ``psycopg_async`` run psycopg alone (a one-row INSERT into a temporary
    table, in one open transaction each): the driver's own async/sync ratio on this machine.
    """

    def __init__(self, broker: Any, actor: dramatiq.Actor[Any, Any], loop: asyncio.AbstractEventLoop, batch: int):
        self.broker, self.actor, self.loop, self.batch = broker, actor, loop, batch
        self.sync_conn = psycopg.connect(DATABASE_URL)
        self.async_conn = loop.run_until_complete(psycopg.AsyncConnection.connect(DATABASE_URL))
        self.sync_conn.execute("CREATE TEMP TABLE native_floor (n int)")
        loop.run_until_complete(self.async_conn.execute("CREATE TEMP TABLE native_floor (n int)"))

    def close(self) -> None:
        self.sync_conn.close()
        self.loop.run_until_complete(self.async_conn.close())

    def psycopg_sync(self, count: int) -> float:
        started = time.perf_counter()
        for n in range(count):
            self.sync_conn.execute(FLOOR_INSERT, (n,))
        return time.perf_counter() - started

    def psycopg_async(self, count: int) -> float:
        async def run() -> float:
            started = time.perf_counter()
            for n in range(count):
                await self.async_conn.execute(FLOOR_INSERT, (n,))
            return time.perf_counter() - started

        return self.loop.run_until_complete(run())

    def sync_transaction(self, count: int) -> float:
        started = time.perf_counter()
        for first in range(0, count, self.batch):
            with self.broker.transaction():
                for n in range(first, min(first + self.batch, count)):
                    self.actor.send(n)
        return time.perf_counter() - started

    def async_transaction(self, count: int) -> float:
        async def run() -> float:
            started = time.perf_counter()
            for first in range(0, count, self.batch):
                async with self.broker.transaction():
                    for n in range(first, min(first + self.batch, count)):
                        await send_async(self.actor, n)
            return time.perf_counter() - started

        return self.loop.run_until_complete(run())

    def sync_autocommit(self, count: int) -> float:
        started = time.perf_counter()
        for n in range(count):
            self.actor.send(n)
        return time.perf_counter() - started

    def async_autocommit(self, count: int) -> float:
        async def run() -> float:
            started = time.perf_counter()
            for n in range(count):
                await send_async(self.actor, n)
            return time.perf_counter() - started

        return self.loop.run_until_complete(run())


def measure_round(ways: Sends, sends: int, batch: int) -> dict[str, float]:
    """Sends/s of every way over ``sends`` sends each, run in slices of ``batch`` sends that
    alternate between the ways (rotating order), so a burst of load on the shared machine
    lands on all of them alike."""
    spent = dict.fromkeys(WAYS, 0.0)
    done = 0
    slice_index = 0
    while done < sends:
        count = min(batch, sends - done)
        shift = slice_index % len(WAYS)
        for way in WAYS[shift:] + WAYS[:shift]:
            spent[way] += getattr(ways, way)(count)
        done += count
        slice_index += 1
    return {way: sends / spent[way] for way in WAYS}


def measure_sends(*, broker_kind: str, rounds: int, sends: int, batch: int) -> dict[str, Any]:
    """The sends/s of every way (medians) and the async/sync ratios (medians of each round's)."""
    schema = f"bench_native_{uuid.uuid4().hex[:10]}"
    migrate(DATABASE_URL, schema=schema)
    broker: Any
    if broker_kind == "outbox":
        broker = OutboxBroker(url=RABBITMQ_URL, database=DATABASE_URL, schema=schema)
    else:
        broker = PostgresBroker(database=DATABASE_URL, schema=schema)
    loop = asyncio.new_event_loop()
    closing: list[Callable[[], None]] = []
    try:
        actor = dramatiq.actor(lambda n: None, actor_name="bench_native", queue_name="bench_native", broker=broker)
        ways = Sends(broker, actor, loop, batch)
        closing.append(ways.close)
        for way in WAYS:  # warm up: pools opened, schema checked, statements prepared
            getattr(ways, way)(min(sends, 200))
        rates: dict[str, list[float]] = {way: [] for way in WAYS}
        ratios: dict[str, list[float]] = {"transaction": [], "autocommit": [], "psycopg": []}
        for index in range(rounds):
            measured = measure_round(ways, sends, batch)
            for way, rate in measured.items():
                rates[way].append(rate)
            for kind in ratios:
                if kind == "psycopg":
                    ratios[kind].append(measured["psycopg_async"] / measured["psycopg_sync"])
                else:
                    ratios[kind].append(measured[f"async_{kind}"] / measured[f"sync_{kind}"])
            log(f"round {index + 1}/{rounds}: " + ", ".join(f"{way} {measured[way]:.0f}/s" for way in WAYS))
        figures: dict[str, Any] = {f"{way}_sends_per_s": round(statistics.median(rates[way]), 1) for way in WAYS}
        for kind, values in ratios.items():
            key = "psycopg_async_ratio" if kind == "psycopg" else f"send_async_ratio_{kind}"
            figures[key] = round(statistics.median(values), 3)
        figures["send_async_ratio"] = min(
            figures["send_async_ratio_transaction"], figures["send_async_ratio_autocommit"]
        )
        return figures
    finally:
        for close in closing:
            close()
        loop.run_until_complete(broker.aclose())
        loop.close()
        with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def django_figures(broker_kind: str, rounds: int) -> dict[str, Any]:
    """``django_send_ratio`` from ``native_django.measure_django()``, or ``null`` and why."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    try:
        from native_django import measure_django  # type: ignore[import-not-found]

        measure: Callable[..., dict[str, Any]] = measure_django
        result = measure(
            database_url=DATABASE_URL, rounds=rounds, broker="postgres" if broker_kind == "queue" else "outbox"
        )
    except ImportError as error:  # the module (another part of the suite) or Django itself missing
        return {"django_send_ratio": None, "django_note": f"benchmarks/native_django.py could not run: {error}"}
    return {"django_send_ratio": result.get("django_send_ratio"), "django": result}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    figures: dict[str, Any] = {"broker": args.broker, "rounds": args.rounds, "sends": args.sends, "batch": args.batch}
    figures.update(measure_sends(broker_kind=args.broker, rounds=args.rounds, sends=args.sends, batch=args.batch))
    if args.no_django:
        figures.update({"django_send_ratio": None, "django_note": "skipped (--no-django)"})
    else:
        figures.update(django_figures(args.broker, args.rounds))
    print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
