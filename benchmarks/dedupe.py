"""Dedupe at enqueue: committed sends per second with a dedupe key against the same sends without, in one run.

    python benchmarks/dedupe.py [--rounds 5] [--seconds 2.0] [--threads 4] [--brokers outbox,queue]

For each broker (``OutboxBroker``, ``PostgresBroker``) three scenarios, interleaved send by send
in every sender thread so machine noise hits them alike (each send is timed); each send is
``with broker.transaction(): actor.send_with_options(...)``, one message per transaction, as an
app sends from a request:
  1. plain:     no dedupe key (the baseline);
  2. keyed:     a fresh dedupe key per send, the cost every keyed send pays (one more statement,
                the ``send_dedupe`` row, in the same transaction);
  3. duplicate: the same key on every send, all of them deduped to the first (informational:
                what a flood of double clicks costs; writes nothing but the key's row lock).
Rates are medians over rounds; ratios the median of each round's ratio.  The last line printed
is one JSON object; ``dedupe_send_ratio`` is keyed / plain on ``OutboxBroker`` (target >= 0.9).
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
from psycopg import sql

from dramatiq_reliable import OutboxBroker, PostgresBroker, migrate

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
RABBITMQ_URL = os.environ.get("RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
BROKERS = ("outbox", "queue")
SCENARIOS = ("plain", "keyed", "duplicate")


def log(text: str) -> None:
    print(text, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--seconds", type=float, default=2.0, help="length of one round per broker (default 2.0)")
    parser.add_argument("--threads", type=int, default=4, help="sender threads (default 4)")
    parser.add_argument("--brokers", default=",".join(BROKERS), help="comma-separated: outbox,queue")
    args = parser.parse_args(argv)
    args.brokers = [name for name in args.brokers.split(",") if name]
    if not args.brokers or set(args.brokers) - set(BROKERS):
        parser.error(f"--brokers takes {','.join(BROKERS)}")
    return args


def measure_round(actor: dramatiq.Actor[Any, Any], broker: Any, threads: int, seconds: float) -> dict[str, float]:
    """Committed sends/s of each scenario, ``threads`` senders for about ``seconds``.

    Each sender cycles through the scenarios send by send and times every send, so the
    scenarios share the machine's state at every moment (other load on a shared machine swings
    a slice-by-slice comparison by more than the difference measured).  A scenario's rate is
    ``threads`` over its mean send time.
    """
    stop = threading.Event()
    spent = [dict.fromkeys(SCENARIOS, 0.0) for _ in range(threads)]
    sent = [dict.fromkeys(SCENARIOS, 0) for _ in range(threads)]
    shared_key = f"dup-{uuid.uuid4().hex}"

    def sender(index: int) -> None:
        turn = index
        while not stop.is_set():
            scenario = SCENARIOS[turn % len(SCENARIOS)]
            turn += 1
            options: dict[str, Any] = {}
            if scenario == "keyed":
                options["dedupe_key"] = uuid.uuid4().hex
            elif scenario == "duplicate":
                options["dedupe_key"] = shared_key
            started = time.perf_counter()
            with broker.transaction():
                actor.send_with_options(args=(index,), **options)
            spent[index][scenario] += time.perf_counter() - started
            sent[index][scenario] += 1

    workers = [threading.Thread(target=sender, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    time.sleep(seconds)
    stop.set()
    for worker in workers:
        worker.join()
    return {
        scenario: threads * sum(c[scenario] for c in sent) / sum(t[scenario] for t in spent) for scenario in SCENARIOS
    }


def truncate(conn: psycopg.Connection[Any], schema: str) -> None:
    for table in ("outbox", "queue", "send_dedupe"):
        conn.execute(sql.SQL("TRUNCATE {}").format(sql.Identifier(schema, table)))


def main(argv: list[str] | None = None) -> None:
    print(json.dumps(measure(parse_args(argv))), flush=True)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every broker's rates and ratios (``benchmarks/job_lifecycle.py`` runs this too)."""
    schema = f"bench_dedupe_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
        migrate(conn, schema=schema)
        brokers: dict[str, Any] = {}
        try:
            if "outbox" in args.brokers:
                brokers["outbox"] = OutboxBroker(
                    url=RABBITMQ_URL, database=DATABASE_URL, schema=schema, pool_max_size=args.threads + 2
                )
            if "queue" in args.brokers:
                brokers["queue"] = PostgresBroker(database=DATABASE_URL, schema=schema, pool_max_size=args.threads + 2)
            actors = {
                name: dramatiq.actor(lambda i: None, actor_name=f"bench_dedupe_{name}", queue_name=schema, broker=b)
                for name, b in brokers.items()
            }
            rates: dict[str, dict[str, list[float]]] = {name: {s: [] for s in SCENARIOS} for name in brokers}
            ratios: dict[str, list[float]] = {name: [] for name in brokers}
            for name, broker in brokers.items():  # warm the pools and the schema checks
                measure_round(actors[name], broker, args.threads, 0.2)
            for round_no in range(args.rounds):
                truncate(conn, schema)
                for name, broker in brokers.items():
                    measured = measure_round(actors[name], broker, args.threads, args.seconds)
                    for scenario in SCENARIOS:
                        rates[name][scenario].append(measured[scenario])
                    ratios[name].append(measured["keyed"] / measured["plain"])
                    log(
                        f"   round {round_no + 1} {name}: "
                        + " ".join(f"{s} {rates[name][s][-1]:,.0f}/s" for s in SCENARIOS)
                        + f" ratio {ratios[name][-1]:.3f}"
                    )
        finally:
            for broker in brokers.values():
                broker.close()
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
    result: dict[str, Any] = {"threads": args.threads, "rounds": args.rounds, "seconds": args.seconds}
    for name in rates:
        suffix = "" if name == "outbox" else "_queue"
        result[f"dedupe_send_ratio{suffix}"] = round(statistics.median(ratios[name]), 3)
        for scenario in SCENARIOS:
            result[f"{scenario}_sends_per_s{suffix}"] = round(statistics.median(rates[name][scenario]), 1)
    return result


if __name__ == "__main__":
    main()
