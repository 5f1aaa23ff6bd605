"""A Django view sending inside ``transaction.atomic()`` against the same view writing only its row.

    python benchmarks/native_django.py [--rounds 5] [--seconds 1.0] [--broker outbox|postgres]

Both views are examples/django_shop's: ``place_order`` creates an ``Order`` and sends its receipt
in one ``atomic()`` block (joined with no ``bind()``: one more INSERT in the same transaction);
``place_order_plain`` creates the ``Order`` only.  They are called through Django's test
``Client`` (URL routing, middleware, the view, the commit), alternating request by request so
machine noise hits both alike; each request is timed.  A round's ratio is the plain view's mean
request time over the sending view's, i.e. sending throughput over plain throughput; the result
is the median over rounds.  The last line printed is one JSON object with ``django_send_ratio``.

Runs on its own database (created and dropped here) on ``DATABASE_URL``'s server.
``benchmarks/native.py`` imports :func:`measure_django`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
RABBITMQ_URL = os.environ.get("RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
SHOP = Path(__file__).resolve().parent.parent / "examples" / "django_shop"


def _configure(database_url: str, name: str, broker: str, schema: str) -> None:
    """Django on database ``name`` with the shop app, once per process."""
    from django.conf import settings

    if settings.configured:
        raise RuntimeError("measure_django() configures Django itself; call it in a process where Django is not set up")
    if str(SHOP) not in sys.path:
        sys.path.insert(0, str(SHOP))
    from shopsite.database import from_url
    from shopsite.standalone import configure

    reliable: dict[str, Any] = {"BROKER": broker, "SCHEMA": schema}
    if broker == "outbox":
        reliable["RABBITMQ_URL"] = RABBITMQ_URL
    # one connection for the run (CONN_MAX_AGE=None), as a real app keeps it
    configure(databases={"default": from_url(database_url, NAME=name, CONN_MAX_AGE=None)}, reliable=reliable)


def _round(client: Any, seconds: float) -> tuple[float, float]:
    """Mean seconds per request of the sending view and of the plain one, alternating."""
    spent = {"send": 0.0, "plain": 0.0}
    done = {"send": 0, "plain": 0}
    deadline = time.perf_counter() + seconds
    turn = 0
    while time.perf_counter() < deadline:
        kind = ("send", "plain")[turn % 2]
        turn += 1
        started = time.perf_counter()
        response = client.post("/orders/" if kind == "send" else "/orders/plain/", {"item": "book"})
        spent[kind] += time.perf_counter() - started
        if response.status_code != 201:
            raise RuntimeError(f"the {kind} view answered {response.status_code}: {response.content[:200]!r}")
        done[kind] += 1
    return spent["send"] / done["send"], spent["plain"] / done["plain"]


def measure_django(
    *, database_url: str = DATABASE_URL, rounds: int = 5, seconds: float = 1.0, broker: str = "outbox"
) -> dict[str, Any]:
    """``{"django_send_ratio": ...}`` (sending view's throughput over the plain view's) and the rates."""
    if rounds < 1 or seconds <= 0 or broker not in ("outbox", "postgres"):
        raise ValueError("rounds >= 1, seconds > 0 and broker 'outbox' or 'postgres', e.g. rounds=5, seconds=1.0")
    name = f"bench_django_{uuid.uuid4().hex[:10]}"
    schema = "dramatiq_reliable"
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        _configure(database_url, name, broker, schema)
        from django.core.management import call_command
        from django.db import connection, connections
        from django.test import Client

        from dramatiq_reliable.django._settings import reset

        call_command("migrate", verbosity=0)  # the shop's tables and ours
        client = Client()
        table = "outbox" if broker == "outbox" else "queue"
        try:
            _round(client, min(seconds, 0.3))  # warm: connection, schema checks, URL resolver
            ratios, send_rates, plain_rates = [], [], []
            for _ in range(rounds):
                with connection.cursor() as cursor:
                    cursor.execute(f'TRUNCATE shop_order, "{schema}"."{table}"')
                send_s, plain_s = _round(client, seconds)
                ratios.append(plain_s / send_s)
                send_rates.append(1 / send_s)
                plain_rates.append(1 / plain_s)
        finally:
            reset()
            connections.close_all()
        return {
            "django_send_ratio": round(statistics.median(ratios), 3),
            "django_send_per_s": round(statistics.median(send_rates)),
            "django_plain_per_s": round(statistics.median(plain_rates)),
            "django_broker": broker,
            "django_rounds": rounds,
        }
    finally:
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
    parser.add_argument("--seconds", type=float, default=1.0, help="length of one round (default 1.0)")
    parser.add_argument("--broker", choices=("outbox", "postgres"), default="outbox", help="the app's broker")
    args = parser.parse_args(argv)
    print(json.dumps(measure_django(rounds=args.rounds, seconds=args.seconds, broker=args.broker)), flush=True)


if __name__ == "__main__":
    main()
