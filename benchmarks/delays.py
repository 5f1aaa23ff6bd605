"""Delays benchmark: delays kept in Postgres (OutboxBroker) against Dramatiq's own ``.DQ`` delays, in one run.

    python benchmarks/delays.py [--messages 10000] [--span-s 60] [--threads 8] [--rabbitmq-url URL]

N messages are sent with delays drawn uniformly from 1 to 60 minutes, compressed: every duration
is multiplied by ``span_s / 3600`` (the default ``--span-s 60``: 60 times faster, so the delays
run from 1 s to 60 s), and so is RabbitMQ's default ``consumer_timeout`` of 30 minutes: the run
starts a RabbitMQ node of its own (tests/rabbitmq_nodes.py; root needed) with ``consumer_timeout``
= 30 min scaled (30 s at the default span) and a 1 s channel tick.  About 4 minutes in all.  Give ``--rabbitmq-url`` to use an
existing server instead (its own ``consumer_timeout`` then applies).

Each case runs one worker process (``--threads`` threads, Dramatiq's default 8) and measures:
  * the worker's RSS before the sends and its peak while the delays wait (``*_rss_growth_mb``);
  * channels closed under the worker (``PRECONDITION_FAILED``, counted from the worker's log);
  * lateness of each message's first run against its eta (p50/p99/max, ms; against the send's
    commit when that came later: 1,000 sends commit together, and a delay compressed to 1 s can
    end before its transaction commits), messages that never ran, and extra runs.
Last, the cost of migration 8's index ``outbox_due`` to producers: committed ``send()`` calls a
second with it and, interleaved, on a schema where it was dropped (``insert_ratio_due_index``).
Cases: ``delays`` (OutboxBroker: each delay is an outbox row a relay thread in this process
publishes when due) and ``baseline`` (Dramatiq's RabbitmqBroker: each delay goes to ``.DQ`` and
waits in worker memory until its eta).  The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import dramatiq
import psycopg
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.common import current_millis
from dramatiq.middleware import CurrentMessage
from psycopg import sql

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
ACTOR = "delayed_job"
READY = "DELAYS-READY"
CLOSED = "PRECONDITION_FAILED"
RABBITMQ_CONSUMER_TIMEOUT_MS = 30 * 60 * 1000


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def build_broker(kind: str, url: str, schema: str) -> Any:
    if kind == "delays":
        from dramatiq_reliable import OutboxBroker

        return OutboxBroker(url=url, database=DATABASE_URL, schema=schema, pool_max_size=4)
    return RabbitmqBroker(url=url)


# -- the worker process ------------------------------------------------------------------------------


class _CountCloses(logging.Handler):
    def __init__(self, out: int) -> None:
        super().__init__()
        self.out = out

    def emit(self, record: logging.LogRecord) -> None:
        if CLOSED in record.getMessage():
            os.write(self.out, b"CLOSE\n")


def worker_main(kind: str, url: str, schema: str, queue: str, out_path: str, threads: int) -> None:
    """Run a worker until stdin closes; each run appends ``<message id> <ms>`` to ``out_path``."""
    out = os.open(out_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    logging.getLogger().addHandler(_CountCloses(out))
    logging.getLogger().setLevel(logging.WARNING)
    broker = build_broker(kind, url, schema)
    broker.add_middleware(CurrentMessage())

    def job() -> None:
        message = CurrentMessage.get_current_message()
        assert message is not None
        os.write(out, f"{message.message_id} {current_millis()}\n".encode())

    dramatiq.actor(job, broker=broker, actor_name=ACTOR, queue_name=queue)
    worker = dramatiq.Worker(broker, worker_threads=threads, worker_timeout=100)
    worker.start()
    print(READY, flush=True)
    sys.stdin.read()  # the parent closes it to stop us
    worker.stop()
    broker.close()


# -- the parent --------------------------------------------------------------------------------------


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def percentile(values: list[int], fraction: float) -> float:
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(fraction * len(ordered)))])


@contextmanager
def rabbitmq_node(url: str | None, span_s: float) -> Iterator[tuple[str, int | None]]:
    """The RabbitMQ URL to use and its consumer_timeout (ms), a node of our own unless ``url`` is given."""
    if url is not None:
        yield url, None
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import rabbitmq_nodes

    reason = rabbitmq_nodes.available()
    if reason is not None:
        raise SystemExit(f"cannot start a RabbitMQ node ({reason}); pass --rabbitmq-url")
    timeout_ms = max(1000, int(RABBITMQ_CONSUMER_TIMEOUT_MS * span_s / 3600))
    log(f"starting a RabbitMQ node with consumer_timeout = {timeout_ms} ms (30 min compressed)")
    with rabbitmq_nodes.single_node(consumer_timeout_ms=timeout_ms, channel_tick_ms=1000) as node:
        yield node.url, timeout_ms


def run_case(kind: str, url: str, schema: str, args: argparse.Namespace, delays_ms: list[int]) -> dict[str, Any]:
    queue = f"perfdelay_{uuid.uuid4().hex[:8]}"
    out_path = f"/tmp/{queue}.runs"
    child = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--worker",
            kind,
            "--url",
            url,
            "--schema",
            schema,
            "--queue",
            queue,
            "--out",
            out_path,
            "--threads",
            str(args.threads),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    broker = build_broker(kind, url, schema)
    relay = None
    relay_thread = None
    try:
        assert child.stdout is not None
        if child.stdout.readline().strip() != READY:
            raise RuntimeError("the worker did not start")
        actor = dramatiq.actor(lambda: None, broker=broker, actor_name=ACTOR, queue_name=queue)
        if kind == "delays":
            from dramatiq_reliable import Relay

            relay = Relay.from_broker(broker)
            relay_thread = threading.Thread(target=relay.run, daemon=True)
            relay_thread.start()
        time.sleep(1.0)  # the worker settles (imports, connections) before its RSS is taken
        rss_before = rss_mb(child.pid)
        peak = [rss_before]
        sampling = threading.Event()

        def sample() -> None:
            while not sampling.wait(0.1):
                with suppress(OSError, RuntimeError):
                    peak.append(rss_mb(child.pid))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        etas: dict[str, int] = {}
        started = time.monotonic()
        # A message cannot run before its send commits: it is due at its eta or its commit,
        # whichever is later (a short delay can end inside the transaction that sent it).
        if kind == "delays":
            for start in range(0, len(delays_ms), 1000):
                chunk = []
                with broker.transaction():
                    for delay in delays_ms[start : start + 1000]:
                        message = actor.send_with_options(delay=delay)
                        chunk.append((message.message_id, message.options["eta"]))
                committed = current_millis()
                etas.update((message_id, max(eta, committed)) for message_id, eta in chunk)
        else:
            for delay in delays_ms:
                message = actor.send_with_options(delay=delay)
                etas[message.message_id] = max(message.options["eta"], current_millis())
        log(f"{kind}: sent {len(etas)} delayed messages in {time.monotonic() - started:.1f}s")

        deadline = time.monotonic() + max(delays_ms) / 1000 + args.grace_s
        runs: dict[str, list[int]] = {}
        closes = 0
        while time.monotonic() < deadline:
            runs, closes = read_runs(out_path)
            if len(runs) >= len(etas) and time.monotonic() - started > max(delays_ms) / 1000:
                break
            time.sleep(0.5)
        time.sleep(1.0)  # late duplicates, if any
        runs, closes = read_runs(out_path)
        sampling.set()
        sampler.join()
        rss_end = rss_mb(child.pid)
        relay_lateness = published_lateness(schema) if kind == "delays" else []
    finally:
        if relay is not None and relay_thread is not None:
            relay.stop()
            relay_thread.join(timeout=30)
        if child.stdin is not None:
            child.stdin.close()
        try:
            child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        broker.flush_all()
        delete_queues(broker, queue)
        broker.close()
        with suppress(OSError):
            os.unlink(out_path)
    lateness = [runs[mid][0] - eta for mid, eta in etas.items() if mid in runs]
    result = {
        "rss_before_mb": round(rss_before, 1),
        "rss_peak_mb": round(max(peak), 1),
        "rss_end_mb": round(rss_end, 1),
        "rss_growth_mb": round(max(peak) - rss_before, 1),
        "channel_closes": closes,
        "ran": len(lateness),
        "never_ran": len(etas) - len(lateness),
        "extra_runs": sum(len(times) - 1 for mid, times in runs.items() if mid in etas),
        "lateness_p50_ms": percentile(lateness, 0.50) if lateness else None,
        "lateness_p99_ms": percentile(lateness, 0.99) if lateness else None,
        "lateness_max_ms": float(max(lateness)) if lateness else None,
        "early_max_ms": float(-min(lateness)) if lateness and min(lateness) < 0 else 0.0,
    }
    if relay_lateness:
        # The relay's part of the lateness: its publish against the row's due time.
        result["relay_lateness_p50_ms"] = percentile(relay_lateness, 0.50)
        result["relay_lateness_p99_ms"] = percentile(relay_lateness, 0.99)
        result["relay_lateness_max_ms"] = float(max(relay_lateness))
    log(f"{kind}: {json.dumps(result)}")
    return result


def published_lateness(schema: str) -> list[int]:
    """Each published row's publish time against its due time, in ms (its commit, if later)."""
    with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
        rows = conn.execute(
            sql.SQL(
                "SELECT (extract(epoch FROM published_at - available_at) * 1000)::bigint FROM {} "
                "WHERE published_at IS NOT NULL"
            ).format(sql.Identifier(schema, "outbox"))
        ).fetchall()
        conn.execute(sql.SQL("DELETE FROM {}").format(sql.Identifier(schema, "outbox")))
    return [int(row[0]) for row in rows]


def index_cost(url: str, rounds: int, sends: int) -> dict[str, Any]:
    """What the index ``outbox_due`` (migration 8) costs a producer: committed sends per second
    with it and, interleaved in the same run, on a schema where it was dropped."""
    from dramatiq_reliable import OutboxBroker, migrate

    rates: dict[str, list[float]] = {"with": [], "without": []}
    schemas = {name: f"perfdelay_{name}_{uuid.uuid4().hex[:8]}" for name in rates}
    brokers: dict[str, Any] = {}
    try:
        for name, schema in schemas.items():
            migrate(DATABASE_URL, schema=schema)
            if name == "without":
                with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
                    conn.execute(sql.SQL("DROP INDEX {}").format(sql.Identifier(schema, "outbox_due")))
            brokers[name] = OutboxBroker(url=url, database=DATABASE_URL, schema=schema, pool_max_size=2)
        actors = {
            name: dramatiq.actor(lambda: None, broker=broker, actor_name=f"insert_{name}", queue_name="perfdelay_q")
            for name, broker in brokers.items()
        }
        for name in rates:  # warm-up: pools, prepared statements
            for _ in range(200):
                actors[name].send()
        # Blocks of 50 sends, alternating schemas and their order, so the other work on the
        # machine (which moves the rates by more than the index) weighs on both alike.
        for _ in range(rounds):
            spent = dict.fromkeys(rates, 0.0)
            for block in range(sends // 50):
                for name in sorted(rates, reverse=bool(block % 2)):
                    started = time.perf_counter()
                    for _ in range(50):
                        actors[name].send()  # unbound: one committed insert each, as an app's autocommit send
                    spent[name] += time.perf_counter() - started
            for name in rates:
                rates[name].append((sends // 50) * 50 / spent[name])
    finally:
        for broker in brokers.values():
            broker.database.close()
        with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
            for schema in schemas.values():
                conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
    with_index, without = (statistics.median(rates[name]) for name in ("with", "without"))
    result = {
        "sends_per_s_with_due_index": round(with_index),
        "sends_per_s_without_due_index": round(without),
        "insert_ratio_due_index": round(with_index / without, 3),
    }
    log(f"index cost: {json.dumps(result)}")
    return result


def read_runs(path: str) -> tuple[dict[str, list[int]], int]:
    runs: dict[str, list[int]] = {}
    closes = 0
    with suppress(FileNotFoundError), open(path) as lines:
        for line in lines:
            if line.startswith("CLOSE"):
                closes += 1
                continue
            parts = line.split()
            if len(parts) == 2:
                runs.setdefault(parts[0], []).append(int(parts[1]))
    return runs, closes


def delete_queues(broker: Any, queue: str) -> None:
    channel = broker.channel if isinstance(broker, RabbitmqBroker) else None
    if channel is None:
        return
    for name in (queue, f"{queue}.DQ", f"{queue}.XQ"):
        with suppress(Exception):
            broker.channel.queue_delete(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=int(os.environ.get("DELAYS_MESSAGES", "10000")))
    parser.add_argument("--span-s", type=float, default=float(os.environ.get("DELAYS_SPAN_S", "60")))
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--grace-s", type=float, default=60.0, help="how long past the last eta to wait for runs")
    parser.add_argument("--rabbitmq-url", default=None)
    parser.add_argument("--seed", type=int, default=22)
    parser.add_argument("--index-rounds", type=int, default=3, help="rounds of the index cost (0: skip it)")
    parser.add_argument("--index-sends", type=int, default=2000, help="committed sends per round and schema")
    parser.add_argument("--worker", choices=("delays", "baseline"), help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--schema", help=argparse.SUPPRESS)
    parser.add_argument("--queue", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main(args.worker, args.url, args.schema, args.queue, args.out, args.threads)
        return

    from dramatiq_reliable import migrate

    scale = args.span_s / 3600
    rng = random.Random(args.seed)
    delays_ms = [int(rng.uniform(60_000, 3_600_000) * scale) for _ in range(args.messages)]
    schema = f"perfdelay_{uuid.uuid4().hex[:8]}"
    migrate(DATABASE_URL, schema=schema)
    load_before = round(os.getloadavg()[0], 2)  # other work on the machine, before and after
    try:
        with rabbitmq_node(args.rabbitmq_url, args.span_s) as (url, timeout_ms):
            ours = run_case("delays", url, schema, args, delays_ms)
            baseline = run_case("baseline", url, schema, args, delays_ms)
            cost = index_cost(url, args.index_rounds, args.index_sends) if args.index_rounds else {}
    finally:
        with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
    print(
        json.dumps(
            {
                "benchmark": "delays",
                "messages": args.messages,
                "scaling": f"1-60 min compressed x{1 / scale:g} ({60 * scale:.1f}-{3600 * scale:.1f} s)",
                "consumer_timeout_ms": timeout_ms,
                "load_average_1m": [load_before, round(os.getloadavg()[0], 2)],
                "worker_threads": args.threads,
                "delays_rss_growth_mb": ours["rss_growth_mb"],
                "baseline_rss_growth_mb": baseline["rss_growth_mb"],
                "channel_closes": ours["channel_closes"],
                "baseline_channel_closes": baseline["channel_closes"],
                "lateness_p50_ms": ours["lateness_p50_ms"],
                "lateness_p99_ms": ours["lateness_p99_ms"],
                "lateness_max_ms": ours["lateness_max_ms"],
                "relay_lateness_p99_ms": ours.get("relay_lateness_p99_ms"),
                "relay_lateness_max_ms": ours.get("relay_lateness_max_ms"),
                "baseline_lateness_p50_ms": baseline["lateness_p50_ms"],
                "baseline_lateness_p99_ms": baseline["lateness_p99_ms"],
                "baseline_lateness_max_ms": baseline["lateness_max_ms"],
                **cost,
                "never_ran": ours["never_ran"],
                "baseline_never_ran": baseline["never_ran"],
                "extra_runs": ours["extra_runs"],
                "baseline_extra_runs": baseline["extra_runs"],
                "delays": ours,
                "baseline": baseline,
            }
        )
    )


if __name__ == "__main__":
    main()
