"""Producer commits and wake-ups: what the outbox and PostgresBroker cost the app's commits, and how fast they wake.

    python benchmarks/producer_commits.py [--rounds 24] [--seconds 0.3] [--connections 1,4,16]
        [--latency-rounds 2] [--latency-seconds 5] [--rate 500] [--idle-samples 4] [--poll-interval-ms N]
        [--cases outbox,pg] [--interleave 1]

A default run takes about 200 s (100 s with ``--cases pg``); raise --rounds and --latency-rounds for steadier figures.

Measures, on the same servers and in one run:
  1. producer commits/s of ``BEGIN; INSERT outbox row; COMMIT`` (the exact SQL of
     ``OutboxBroker``'s send, one row per transaction, pipelined into one round trip) at 1, 4
     and 16 connections, against three identical tables: the outbox as migrated today (ours),
     the same table with no trigger at all (the baseline), and the same table with the old
     0001 ``outbox_notify`` trigger.  Rounds are interleaved (each round runs a short slice of
     every table at every connection count, in a rotating order); commits/s are medians over
     rounds, ratios the median of each round's ratio.  16 connections stay open for the whole
     run, as threads in 4 processes, and take part as each slice asks.
  2. commit-to-receipt latency p50/p99 at a steady ``--rate`` messages/s: ``actor.send()``
     committing each message alone, a real ``Relay`` and a consumer on RabbitMQ; then the
     same with the 0001 trigger put back (the relay then also wakes on every commit's NOTIFY).
  3. the latency of the first message after the relay idled down to its ceiling
     (``poll_interval_ms``), sent at a random moment of its sleep.
  4. the idle relay's load on Postgres: its probes per second, and one probe's round trip and
     backend CPU (read from ``/proc`` when Postgres runs on this machine).
  5. PostgresBroker's producers: commits/s of ``PostgresBroker.send()``'s exact insert into
     three identical queue tables (migrated today, no trigger, migration 4's NOTIFY trigger),
     interleaved as in 1; ``pg_commit_ratio_min`` is the least ratio over the connection counts.
  6. PostgresBroker's claim latency at a steady ``--rate``: ``actor.send()`` in another process
     (the usual producer), each committed alone, a real consumer here (prefetch 64), from commit
     to claim; alternating with migration 4's trigger put back (consumers then also wake on every
     commit's NOTIFY).  ``pg_latency_p50_ms`` and ``pg_latency_p99_ms`` are medians over rounds.
  7. PostgresBroker: the first message after the consumer idled down to ``poll_interval_ms``.
``--cases pg`` runs 5-7 only (no RabbitMQ needed).
The last line printed is one JSON object with the figures and ratios.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import queue as queue_module
import random
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import dramatiq
import pika
import psycopg
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.common import dq_name, xq_name
from psycopg import sql

from dramatiq_reliable import OutboxBroker, PostgresBroker, Relay, _sql, migrate, schema
from dramatiq_reliable.outbox import RelayOptions, wake

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
RABBITMQ_URL = os.environ.get("RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
# Processes that run the producer connections (as threads): bounded, whatever --connections says.
MAX_PROCESSES = 4
VARIANTS = ("ours", "plain", "old_trigger")
# Threads acking the PostgresBroker consumer's messages (see PgConsumer).
ACK_THREADS = 8


def log(text: str) -> None:
    print(text, flush=True)


# -- 1. producer commits -------------------------------------------------------------------------


class Producers:
    """16 producer connections kept open for the whole benchmark: threads in ``MAX_PROCESSES`` processes.

    The parent runs short slices: it names the table and how many connections take part, lets
    them commit for a while, pauses them and reads their counts.  Connection ``c`` runs in
    process ``c % MAX_PROCESSES``, so the first 4 are spread over all processes.
    """

    def __init__(self, schemas: list[str], connections: int, body: bytes, table: str = "outbox") -> None:
        context = multiprocessing.get_context("fork")
        self.connections = connections
        self.priority_zero = table == "queue"
        self.state = context.Value("i", 0, lock=False)  # 0 paused, 1 running, 2 exit
        self.variant = context.Value("i", 0, lock=False)
        self.active = context.Value("i", 0, lock=False)
        self.counts = context.Array("q", connections, lock=False)
        self.busy = context.Array("i", connections, lock=False)
        self.ready = context.Array("i", connections, lock=False)
        self.children = [
            context.Process(target=self._process, args=(schemas, body, p, table), daemon=True)
            for p in range(min(connections, MAX_PROCESSES))
        ]
        for child in self.children:
            child.start()
        deadline = time.monotonic() + 60
        while sum(self.ready) < connections:
            if time.monotonic() > deadline:
                raise RuntimeError("producer connections did not open within 60 s")
            time.sleep(0.01)

    def _process(self, schemas: list[str], body: bytes, process: int, table: str) -> None:
        # The exact insert of OutboxBroker.send() or PostgresBroker.send().
        inserts = [_sql.query(f"{table}_insert", name) for name in schemas]
        mine = [c for c in range(self.connections) if c % MAX_PROCESSES == process]
        threads = [threading.Thread(target=self._connection, args=(c, inserts, body)) for c in mine]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def _connection(self, c: int, inserts: list[Any], body: bytes) -> None:
        with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
            self.ready[c] = 1
            while True:
                state = self.state.value
                if state == 2:
                    return
                if state == 0 or c >= self.active.value:
                    time.sleep(0.001)
                    continue
                self.busy[c] = 1
                params = {
                    "message_id": uuid.uuid4().hex,
                    "queue_name": "perfwake_q",
                    "actor_name": "perfwake_actor",
                    "body": body,
                    # The queue's priority is NOT NULL (PostgresBroker sends 0); the outbox's is not.
                    "priority": 0 if self.priority_zero else None,
                    "eta_ms": None,
                }
                # The transaction a producer runs, in one round trip.
                with conn.pipeline():
                    conn.execute("BEGIN")
                    conn.execute(inserts[self.variant.value], params)
                    conn.execute("COMMIT")
                self.counts[c] += 1
                self.busy[c] = 0

    def measure(self, variant: int, active: int, seconds: float) -> float:
        """Commits/s of ``active`` connections into table ``variant`` over about ``seconds``."""
        self.variant.value, self.active.value = variant, active
        for c in range(self.connections):
            self.counts[c] = 0
        started = time.perf_counter()
        self.state.value = 1
        time.sleep(seconds)
        self.state.value = 0
        while any(self.busy):  # the transactions in flight finish (and count)
            time.sleep(0.0005)
        return sum(self.counts) / (time.perf_counter() - started)

    def close(self) -> None:
        self.state.value = 2
        for child in self.children:
            child.join(30)


def build_tables(conn: psycopg.Connection[Any], base: str) -> dict[str, str]:
    """Three schemas whose outbox tables are identical but for their triggers; returns variant -> schema."""
    migrate(conn, schema=base)
    first = schema.migrations()[0]
    assert first.version == 1
    assert "outbox_notify" in first.text
    plain, old = f"{base}_plain", f"{base}_old"
    for name in (plain, old):
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(name)))
        # 0001 exactly as it shipped: the table, its indexes and the statement-level NOTIFY trigger.
        conn.execute(_sql.compose(first.text, name))
    conn.execute(sql.SQL("DROP TRIGGER outbox_notify ON {}").format(sql.Identifier(plain, "outbox")))
    return {"ours": base, "plain": plain, "old_trigger": old}


def truncate(conn: psycopg.Connection[Any], schemas: dict[str, str], table: str = "outbox") -> None:
    for name in schemas.values():
        conn.execute(sql.SQL("TRUNCATE {}").format(sql.Identifier(name, table)))


def measure_commits(
    conn: psycopg.Connection[Any],
    schemas: dict[str, str],
    args: argparse.Namespace,
    body: bytes,
    table: str = "outbox",
) -> dict[str, dict[int, list[float]]]:
    """Interleaved slices: every round runs each table at each connection count, in rotating order."""
    runs: dict[str, dict[int, list[float]]] = {v: {n: [] for n in args.connections} for v in VARIANTS}
    producers = Producers([schemas[v] for v in VARIANTS], max(args.connections), body, table)
    # Every order of the three tables, cycled so that at each connection count each table runs
    # first, second and last equally often: the slice after a change of connection count runs
    # on a server still settling from the one before.
    orders = list(itertools.permutations(range(len(VARIANTS))))
    try:
        for round_no in range(args.rounds):
            if round_no % 4 == 0:
                truncate(conn, schemas, table)  # the three tables stay small and alike
            for index, connections in enumerate(args.connections):
                order = orders[(round_no + 2 * index) % len(orders)]
                # Settle (not counted) on the table that runs first, so no table is favoured.
                producers.measure(order[0], connections, args.seconds / 3)
                # A slice is cut into --interleave parts run in turn (ABC CBA ...), so a burst of
                # load from other work lands on every table alike instead of on one.
                rates = dict.fromkeys(order, 0.0)
                for part in range(args.interleave):
                    for variant in order if part % 2 == 0 else order[::-1]:
                        rates[variant] += producers.measure(variant, connections, args.seconds / args.interleave)
                for variant in order:
                    runs[VARIANTS[variant]][connections].append(rates[variant] / args.interleave)
            log(
                f"   round {round_no + 1}: "
                + "; ".join(
                    f"{n} conn " + " ".join(f"{v} {runs[v][n][-1]:,.0f}" for v in VARIANTS) for n in args.connections
                )
            )
    finally:
        producers.close()
    return runs


# -- 2-4. the relay ------------------------------------------------------------------------------


class Probe:
    """Counts a relay's idle probes and passes by wrapping them (the relay is not otherwise changed)."""

    def __init__(self, relay: Relay) -> None:
        self.probes = 0
        self.passes = 0
        probe, drain_once = relay._probe, relay.drain_once

        def counted_probe() -> bool:
            self.probes += 1
            return probe()

        def counted_pass() -> Any:
            self.passes += 1
            return drain_once()

        relay._probe = counted_probe  # type: ignore[method-assign]
        relay.drain_once = counted_pass  # type: ignore[method-assign]


class Consumer:
    """Records when each message reaches a RabbitMQ consumer."""

    def __init__(self, queue: str) -> None:
        self.received: dict[str, float] = {}
        self._stop = threading.Event()
        ready = threading.Event()

        def consume() -> None:
            connection = pika.BlockingConnection(pika.URLParameters(RABBITMQ_URL))
            channel = connection.channel()
            channel.basic_qos(prefetch_count=1000)
            ready.set()
            for method, _props, body in channel.consume(queue, auto_ack=True, inactivity_timeout=0.05):
                if method is not None:
                    self.received[json.loads(body)["message_id"]] = time.perf_counter()
                if self._stop.is_set():
                    break
            channel.cancel()
            connection.close()

        self._thread = threading.Thread(target=consume, daemon=True)
        self._thread.start()
        ready.wait(10)

    def wait_for(self, message_ids: Callable[[], set[str]], timeout_s: float) -> None:
        deadline = time.perf_counter() + timeout_s
        while not message_ids() <= self.received.keys() and time.perf_counter() < deadline:
            time.sleep(0.01)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(30)


def _paired(ours: list[float], baseline: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(ours, baseline, strict=True))


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def steady_latency(
    broker: OutboxBroker, actor: Any, queue: str, args: argparse.Namespace
) -> tuple[float, float, int, float, float]:
    """Steady ``args.rate`` sends/s, each committed alone: p50, p99 ms, lost, probes/s, passes/s."""
    relay = Relay.from_broker(broker, poll_interval_ms=poll_interval_ms(args))
    counter = Probe(relay)
    consumer = Consumer(queue)
    thread = threading.Thread(target=relay.run, daemon=True)
    thread.start()
    time.sleep(0.5)  # the relay's LISTEN connection and first pass
    committed: dict[str, float] = {}
    # The senders start a second before the window: an idle relay's first rows wait for the
    # sleep in progress (measured on their own by idle_wake()), which is not the steady state.
    warm_up_s = 1.0
    probes0 = passes0 = 0
    started = time.perf_counter() + warm_up_s
    end = started + args.latency_seconds

    def send(offset: float) -> None:
        # Each sender keeps its share of the rate; several, because one commit (an fsync)
        # can take longer than the interval on a busy machine.
        nonlocal probes0, passes0
        interval = args.senders / args.rate
        next_at = started - warm_up_s + offset * interval
        while next_at < end:
            delay = next_at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            message = actor.send(0)  # unbound: inserted and committed before send() returns
            if next_at >= started:
                if not committed:
                    probes0, passes0 = counter.probes, counter.passes
                committed[message.message_id] = time.perf_counter()
            next_at += interval

    senders = [threading.Thread(target=send, args=(i / args.senders,)) for i in range(args.senders)]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join()
    elapsed = time.perf_counter() - started
    log(f"   (sent {len(committed) / elapsed:,.0f} msg/s)")
    probes, passes = counter.probes - probes0, counter.passes - passes0
    consumer.wait_for(lambda: set(committed), 30)
    relay.stop()
    thread.join(30)
    consumer.close()
    samples = [(consumer.received[m] - committed[m]) * 1000 for m in committed if m in consumer.received]
    lost = len(committed) - len(samples)
    return statistics.median(samples), _percentile(samples, 0.99), lost, probes / elapsed, passes / elapsed


def idle_wake(
    broker: OutboxBroker, actor: Any, queue: str, args: argparse.Namespace
) -> tuple[list[float], float, float]:
    """First-message latency after an idle down to the ceiling; and the idle relay's probes/s."""
    ceiling_s = poll_interval_ms(args) / 1000
    relay = Relay.from_broker(broker, poll_interval_ms=poll_interval_ms(args))
    counter = Probe(relay)
    consumer = Consumer(queue)
    thread = threading.Thread(target=relay.run, daemon=True)
    thread.start()
    samples: list[float] = []
    try:
        for _ in range(args.idle_samples):
            # Idle down to the ceiling: its sleeps are then drawn from [ceiling/2, ceiling].
            while (relay._sleeping_s or 0) < ceiling_s / 2:
                time.sleep(0.005)
            time.sleep(random.uniform(0, 2 * ceiling_s))  # a random moment of its sleep
            message = actor.send(0)
            committed = time.perf_counter()
            consumer.wait_for(lambda m=message.message_id: {m}, ceiling_s + 30)
            samples.append((consumer.received[message.message_id] - committed) * 1000)
        # The idle relay's own probe rate: over a window of many sleeps at the ceiling.
        while (relay._sleeping_s or 0) < ceiling_s / 2:
            time.sleep(0.005)
        probes0, window_started = counter.probes, time.perf_counter()
        time.sleep(max(2.0, 10 * ceiling_s))
        idle_rate = (counter.probes - probes0) / (time.perf_counter() - window_started)
    finally:
        relay.stop()
        thread.join(30)
        consumer.close()
    # Sleeps drawn from [ceiling/2, ceiling]: 0.75 of the ceiling on average.
    expected = 1 / (0.75 * ceiling_s)
    return samples, idle_rate, expected


def probe_cost(schema_name: str, probes: int) -> tuple[float, float | None]:
    """One idle probe on the emptied outbox: round trip µs, and backend CPU µs (None without /proc)."""
    query = _sql.query("outbox_probe", schema_name)
    with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
        pid = conn.info.backend_pid

        def cpu_s() -> float | None:
            try:
                with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                return None
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

        for _ in range(50):
            conn.execute(query, {"max_attempts": 25})  # prepared, plan cached
        cpu0, started = cpu_s(), time.perf_counter()
        for _ in range(probes):
            conn.execute(query, {"max_attempts": 25}).fetchone()
        wall = time.perf_counter() - started
        cpu1 = cpu_s()
    cpu = None if cpu0 is None or cpu1 is None else (cpu1 - cpu0) / probes * 1e6
    return wall / probes * 1e6, cpu


def poll_interval_ms(args: argparse.Namespace) -> int:
    """The relay's idle ceiling: --poll-interval-ms, or the relay's default."""
    return RelayOptions.poll_interval_ms if args.poll_interval_ms is None else int(args.poll_interval_ms)


def put_old_trigger_back(conn: psycopg.Connection[Any], schema_name: str) -> None:
    """The 0001 trigger and its function, on the migrated outbox: the design before migration 0006."""
    text = schema.migrations()[0].text
    conn.execute(_sql.compose(text[text.index("CREATE FUNCTION") :], schema_name))


def drop_old_trigger(conn: psycopg.Connection[Any], schema_name: str) -> None:
    """What migration 0006 does."""
    conn.execute(_sql.compose(schema.migrations()[5].text, schema_name))


# -- 5-6. PostgresBroker -------------------------------------------------------------------------


def build_queue_tables(conn: psycopg.Connection[Any], base: str) -> dict[str, str]:
    """Three migrated schemas whose queue tables are identical but for their triggers: ours (no
    trigger since migration 18), the baseline (the same, as the issue's "same insert with no
    trigger"), and migration 4's NOTIFY trigger put back (the design before 18)."""
    plain, old = f"{base}_qplain", f"{base}_qold"
    for name in (plain, old):
        migrate(conn, schema=name)
    put_queue_trigger_back(conn, old)
    return {"ours": base, "plain": plain, "old_trigger": old}


def put_queue_trigger_back(conn: psycopg.Connection[Any], schema_name: str) -> None:
    """Migration 4's trigger and its function, on the migrated queue table: the design before 18."""
    text = schema.migrations()[3].text
    conn.execute(_sql.compose(text[text.index("CREATE FUNCTION") :], schema_name))


def drop_queue_trigger(conn: psycopg.Connection[Any], schema_name: str) -> None:
    conn.execute(sql.SQL("DROP TRIGGER queue_notify ON {}").format(sql.Identifier(schema_name, "queue")))
    conn.execute(sql.SQL("DROP FUNCTION {}()").format(sql.Identifier(schema_name, "queue_notify")))


def _pg_producer(schema_name: str, queue: str, args: argparse.Namespace, start_at: float, sink: Any) -> None:
    """Another process (the usual producer): ``actor.send()`` at ``args.rate``/s, each committed
    alone, from ``args.senders`` threads; sends back ``{message_id: perf_counter at commit}``."""
    broker = PostgresBroker(database=DATABASE_URL, schema=schema_name, pool_max_size=args.senders + 1)
    actor = dramatiq.actor(lambda n: None, actor_name="perfwake_pg", queue_name=queue, broker=broker)
    committed: dict[str, float] = {}
    end = start_at + args.latency_seconds
    warm_up_s = 1.0

    def send(offset: float) -> None:
        interval = args.senders / args.rate
        next_at = start_at - warm_up_s + offset * interval
        while next_at < end:
            delay = next_at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            message = actor.send(0)  # unbound: inserted and committed before send() returns
            if next_at >= start_at:
                committed[message.message_id] = time.perf_counter()
            next_at += interval

    threads = [threading.Thread(target=send, args=(i / args.senders,)) for i in range(args.senders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    broker.close()
    sink.send(committed)
    sink.close()


class PgConsumer:
    """A real PostgresBroker consumer in this process, recording when each message is claimed."""

    def __init__(self, broker: PostgresBroker, queue: str) -> None:
        self.received: dict[str, float] = {}
        self.claims = 0
        self._stop = threading.Event()
        self.consumer = broker.consume(queue, prefetch=64, timeout=100)
        claim = self.consumer._claim

        def counted_claim(limit: int) -> bool:
            self.claims += 1
            return claim(limit)

        self.consumer._claim = counted_claim  # type: ignore[method-assign]
        # Acks from 8 threads, as 8 worker threads finish jobs: the broker writes the acks that
        # gather while one is written in one DELETE.  (Acked from the claiming thread one by one,
        # each ack is a round trip and caps this consumer at a few hundred messages a second on
        # a loaded machine, which would measure the acks, not the wake-up.)
        self._done: queue_module.SimpleQueue[Any] = queue_module.SimpleQueue()
        self._threads = [threading.Thread(target=self._run, daemon=True)] + [
            threading.Thread(target=self._ack, daemon=True) for _ in range(ACK_THREADS)
        ]
        for thread in self._threads:
            thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            message = next(self.consumer)
            if message is not None:
                self.received[message.message_id] = time.perf_counter()
                self._done.put(message)
        for _ in range(ACK_THREADS):
            self._done.put(None)

    def _ack(self) -> None:
        while (message := self._done.get()) is not None:
            self.consumer.ack(message)

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)
        self.consumer.close()


def pg_steady_latency(broker: PostgresBroker, queue: str, args: argparse.Namespace) -> tuple[float, float, int, float]:
    """Claim latency of sends committed by another process at a steady rate: p50, p99 ms, lost, claims/s."""
    consumer = PgConsumer(broker, queue)
    time.sleep(0.5)  # the listener's LISTEN and the consumer's first claims
    context = multiprocessing.get_context("fork")
    receive, sink = context.Pipe(duplex=False)
    start_at = time.perf_counter() + 1.5  # after the child's start and its 1 s warm-up
    child = context.Process(target=_pg_producer, args=(broker.schema, queue, args, start_at, sink), daemon=True)
    child.start()
    committed: dict[str, float] = receive.recv()
    child.join(30)
    deadline = time.perf_counter() + 30
    while not committed.keys() <= consumer.received.keys() and time.perf_counter() < deadline:
        time.sleep(0.01)
    consumer.close()
    log(f"   (sent {len(committed) / args.latency_seconds:,.0f} msg/s)")
    samples = [(consumer.received[m] - committed[m]) * 1000 for m in committed if m in consumer.received]
    claims_per_s = consumer.claims / (args.latency_seconds + 2.0)
    return statistics.median(samples), _percentile(samples, 0.99), len(committed) - len(samples), claims_per_s


def pg_idle_wake(broker: PostgresBroker, sender: PostgresBroker, queue: str, samples: int) -> list[float]:
    """First-message latency after the consumer idled down to its ceiling, sent by another broker
    (this process's broker would wake its own consumer directly)."""
    ceiling_s = broker.poll_interval_ms / 1000
    actor = dramatiq.actor(lambda n: None, actor_name="perfwake_pg_idle", queue_name=queue, broker=sender)
    consumer = PgConsumer(broker, queue)
    found: list[float] = []
    try:
        for _ in range(samples):
            # Idle down to the ceiling: each empty claim grows the sleep by a quarter.
            while wake.FIRST_IDLE_S * wake.GROWTH**consumer.consumer._empty_claims < ceiling_s:
                time.sleep(0.005)
            time.sleep(random.uniform(0, 2 * ceiling_s))  # a random moment of its sleep
            message = actor.send(0)
            committed = time.perf_counter()
            deadline = committed + ceiling_s + 30
            while message.message_id not in consumer.received and time.perf_counter() < deadline:
                time.sleep(0.001)
            found.append((consumer.received[message.message_id] - committed) * 1000)
    finally:
        consumer.close()
    return found


def postgres_broker_case(admin: psycopg.Connection[Any], base: str, args: argparse.Namespace) -> dict[str, Any]:
    """Producer commits into the queue table (ours, no trigger, old trigger) and claim latency."""
    queue_schemas = build_queue_tables(admin, base)
    queue = f"perfwake_pg_{uuid.uuid4().hex[:8]}"
    broker = PostgresBroker(database=DATABASE_URL, schema=base)
    sender = PostgresBroker(database=DATABASE_URL, schema=base)
    results: dict[str, Any] = {}
    try:
        actor = dramatiq.actor(lambda n: None, actor_name="perfwake_pg", queue_name=queue, broker=broker)
        body = actor.message(0).encode()
        ratios: dict[int, float] = {}
        old_ratios: dict[int, float] = {}
        spread: dict[int, tuple[float, float]] = {}
        median: dict[str, dict[int, float]] = {v: {} for v in VARIANTS}
        if args.rounds:
            log(
                f"5. PostgresBroker producer commits/s, {args.rounds} rounds x {args.seconds}s at "
                f"{args.connections} connections ({len(body)}-byte rows)"
            )
            runs = measure_commits(admin, queue_schemas, args, body, table="queue")
            median = {v: {n: statistics.median(runs[v][n]) for n in args.connections} for v in VARIANTS}
            ratios = {n: _paired(runs["ours"][n], runs["plain"][n]) for n in args.connections}
            old_ratios = {n: _paired(runs["old_trigger"][n], runs["plain"][n]) for n in args.connections}
            for n in args.connections:
                each = [a / b for a, b in zip(runs["ours"][n], runs["plain"][n], strict=True)]
                spread[n] = (min(each), max(each))
                log(
                    f"   {n:>2} conn: ours {median['ours'][n]:,.0f}/s, no trigger {median['plain'][n]:,.0f}/s "
                    f"({ratios[n]:.3f}, rounds {spread[n][0]:.2f}-{spread[n][1]:.2f}), "
                    f"0004 trigger {median['old_trigger'][n]:,.0f}/s ({old_ratios[n]:.3f})"
                )
            truncate(admin, queue_schemas, "queue")
        log(
            f"6. PostgresBroker claim latency at {args.rate} msg/s from another process, "
            f"{args.latency_rounds} rounds x {args.latency_seconds}s, ours (ceiling {broker.poll_interval_ms} ms) "
            "and the 0004 trigger put back, alternating"
        )
        latency: dict[str, list[tuple[float, float, int, float]]] = {"ours": [], "old_trigger": []}
        for _ in range(args.latency_rounds):
            for variant in ("ours", "old_trigger"):
                if variant == "old_trigger":
                    put_queue_trigger_back(admin, base)
                measured = pg_steady_latency(broker, queue, args)
                if variant == "old_trigger":
                    drop_queue_trigger(admin, base)
                latency[variant].append(measured)
                log(
                    f"   {variant}: p50 {measured[0]:.2f} ms, p99 {measured[1]:.2f} ms, undelivered {measured[2]}; "
                    f"{measured[3]:,.0f} claims/s"
                )

        def med(variant: str, index: int) -> float | None:
            return statistics.median(m[index] for m in latency[variant]) if latency[variant] else None

        def rounded(value: float | None) -> float | None:
            return None if value is None else round(value, 2)

        def latency_spread(index: int) -> list[float] | None:
            ours = [m[index] for m in latency["ours"]]
            return [round(min(ours), 2), round(max(ours), 2)] if ours else None

        log(f"7. PostgresBroker: first message after an idle, {args.idle_samples} samples")
        wakes = pg_idle_wake(broker, sender, queue, args.idle_samples)
        log(f"   {', '.join(f'{w:.0f}' for w in wakes)} ms (ceiling {broker.poll_interval_ms} ms)")
        results = {
            "pg_commit_ratio_min": round(min(ratios.values()), 3) if ratios else None,
            "pg_latency_p50_ms": rounded(med("ours", 0)),
            "pg_latency_p99_ms": rounded(med("ours", 1)),
            **{f"pg_commit_ratio_{n}": round(r, 3) for n, r in ratios.items()},
            **{f"pg_commit_ratio_{n}_spread": [round(lo, 3), round(hi, 3)] for n, (lo, hi) in spread.items()},
            "pg_old_trigger_ratio_min": round(min(old_ratios.values()), 3) if old_ratios else None,
            **{f"pg_old_trigger_ratio_{n}": round(r, 3) for n, r in old_ratios.items()},
            "pg_commits_per_s": {v: {str(n): round(rate) for n, rate in median[v].items()} for v in VARIANTS},
            "pg_latency_p50_ms_spread": latency_spread(0),
            "pg_latency_p99_ms_spread": latency_spread(1),
            "pg_latency_undelivered": sum(m[2] for v in latency.values() for m in v),
            "pg_old_trigger_latency_p50_ms": rounded(med("old_trigger", 0)),
            "pg_old_trigger_latency_p99_ms": rounded(med("old_trigger", 1)),
            "pg_steady_claims_per_s": rounded(med("ours", 3)),
            "pg_idle_wake_ms_median": round(statistics.median(wakes), 1) if wakes else None,
            "pg_idle_wake_ms_max": round(max(wakes), 1) if wakes else None,
            "pg_poll_interval_ms": broker.poll_interval_ms,
        }
    finally:
        broker.close()
        sender.close()
        for name in queue_schemas.values():
            if name != base:
                admin.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))
    return results


# -- main ----------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=24, help="interleaved rounds of the commit benchmark")
    parser.add_argument("--seconds", type=float, default=0.3, help="length of one commit slice")
    parser.add_argument(
        "--interleave", type=int, default=1, help="parts each commit slice is cut into, run in turn across tables"
    )
    parser.add_argument(
        "--connections", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16], help="e.g. 1,4,16"
    )
    parser.add_argument("--latency-seconds", type=float, default=5.0, help="length of one latency measurement")
    parser.add_argument(
        "--latency-rounds", type=int, default=2, help="alternating rounds of ours and the 0001 trigger; medians"
    )
    parser.add_argument("--rate", type=int, default=500)
    parser.add_argument("--senders", type=int, default=4, help="threads sharing the steady rate")
    parser.add_argument("--idle-samples", type=int, default=4)
    parser.add_argument("--probes", type=int, default=3000, help="probes timed for the probe's cost")
    parser.add_argument(
        "--poll-interval-ms", type=int, default=None, help="the relay's idle ceiling (default: the library's)"
    )
    parser.add_argument(
        "--cases",
        type=lambda s: set(s.split(",")),
        default={"outbox", "pg"},
        help="outbox,pg (default both): the outbox's producers and relay, PostgresBroker's producers and consumers",
    )
    args = parser.parse_args()
    if not args.cases or args.cases - {"outbox", "pg"}:
        parser.error(f"--cases takes outbox, pg or both, got {sorted(args.cases)!r}")
    if max(args.connections) > 16:
        parser.error("at most 16 connections: the machine's Postgres is shared (max_connections 100)")

    base = f"perfwake_{uuid.uuid4().hex[:8]}"
    queue = f"perfwake_{uuid.uuid4().hex[:8]}"
    results: dict[str, Any] = {}
    admin = psycopg.connect(DATABASE_URL, autocommit=True)
    # Named before they exist, so the cleanup below drops whatever was created.
    schemas = {"ours": base, "plain": f"{base}_plain", "old_trigger": f"{base}_old"}
    broker: OutboxBroker | None = None
    if "outbox" not in args.cases:
        try:
            migrate(admin, schema=base)
            results = postgres_broker_case(admin, base, args)
        finally:
            admin.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(base)))
            admin.close()
        print(json.dumps(results))
        return
    try:
        schemas = build_tables(admin, base)
        broker = OutboxBroker(url=RABBITMQ_URL, database=DATABASE_URL, schema=base)
        actor = dramatiq.actor(lambda n: None, actor_name="perfwake_actor", queue_name=queue, broker=broker)
        body = actor.message(0).encode()

        ratios: dict[int, float] = {}
        old_ratios: dict[int, float] = {}
        median: dict[str, dict[int, float]] = {v: {} for v in VARIANTS}
        if args.rounds:
            log(
                f"1. producer commits/s, {args.rounds} rounds x {args.seconds}s at {args.connections} connections "
                f"({len(body)}-byte rows)"
            )
            runs = measure_commits(admin, schemas, args, body)
            median = {v: {n: statistics.median(runs[v][n]) for n in args.connections} for v in VARIANTS}
            # Each round's ratio pairs slices run seconds apart: the median of those resists the
            # machine's load changing during the run better than a ratio of medians.
            ratios = {n: _paired(runs["ours"][n], runs["plain"][n]) for n in args.connections}
            old_ratios = {n: _paired(runs["old_trigger"][n], runs["plain"][n]) for n in args.connections}
            for n in args.connections:
                log(
                    f"   {n:>2} conn: ours {median['ours'][n]:,.0f}/s, no trigger {median['plain'][n]:,.0f}/s "
                    f"({ratios[n]:.3f}), 0001 trigger {median['old_trigger'][n]:,.0f}/s ({old_ratios[n]:.3f})"
                )
            truncate(admin, schemas)

        RabbitmqBroker(url=RABBITMQ_URL, middleware=[]).declare_queue(queue, ensure=True)
        ceiling = poll_interval_ms(args)
        log(
            f"2. commit-to-receipt latency at {args.rate} msg/s, {args.latency_rounds} rounds x "
            f"{args.latency_seconds}s, ours (ceiling {ceiling} ms) then the 0001 trigger put back"
        )
        latency: dict[str, list[tuple[float, float, int, float, float]]] = {"ours": [], "old_trigger": []}
        for _ in range(args.latency_rounds):
            for variant in ("ours", "old_trigger"):
                if variant == "old_trigger":
                    put_old_trigger_back(admin, base)
                measured = steady_latency(broker, actor, queue, args)
                if variant == "old_trigger":
                    drop_old_trigger(admin, base)
                latency[variant].append(measured)
                p50_, p99_, lost_, probes_, passes_ = measured
                log(
                    f"   {variant}: p50 {p50_:.2f} ms, p99 {p99_:.2f} ms, undelivered {lost_}; "
                    f"{probes_:,.0f} probes/s and {passes_:,.0f} passes/s"
                )

        def med(variant: str, index: int) -> float:
            return statistics.median(m[index] for m in latency[variant])

        p50, p99, old_p50, old_p99 = med("ours", 0), med("ours", 1), med("old_trigger", 0), med("old_trigger", 1)
        lost = sum(m[2] for m in latency["ours"]) + sum(m[2] for m in latency["old_trigger"])
        steady_probes, steady_passes = med("ours", 3), med("ours", 4)

        log(f"3. first message after an idle, {args.idle_samples} samples")
        wakes, idle_probes, expected_probes = idle_wake(broker, actor, queue, args)
        log(
            f"   {', '.join(f'{w:.0f}' for w in wakes)} ms (ceiling {ceiling} ms); "
            f"idle probes {idle_probes:.1f}/s per relay (expected {expected_probes:.1f}/s)"
        )

        log(f"4. one idle probe's cost, {args.probes} probes")
        probe_us, probe_cpu_us = probe_cost(base, args.probes)
        cpu_text = "n/a (Postgres not on this machine)" if probe_cpu_us is None else f"{probe_cpu_us:.1f} us"
        log(f"   round trip {probe_us:.1f} us, backend CPU {cpu_text}")

        results = {
            "commit_ratio_min": round(min(ratios.values()), 3) if ratios else None,
            "latency_p50_ms": round(p50, 2),
            "latency_p99_ms": round(p99, 2),
            **{f"commit_ratio_{n}": round(r, 3) for n, r in ratios.items()},
            "old_trigger_ratio_min": round(min(old_ratios.values()), 3) if old_ratios else None,
            **{f"old_trigger_ratio_{n}": round(r, 3) for n, r in old_ratios.items()},
            "commits_per_s": {v: {str(n): round(rate) for n, rate in median[v].items()} for v in VARIANTS},
            "latency_undelivered": lost,
            "old_trigger_latency_p50_ms": round(old_p50, 2),
            "old_trigger_latency_p99_ms": round(old_p99, 2),
            "idle_wake_ms_median": round(statistics.median(wakes), 1),
            "idle_wake_ms_max": round(max(wakes), 1),
            "poll_interval_ms": ceiling,
            "idle_probes_per_s": round(idle_probes, 2),
            "steady_probes_per_s": round(steady_probes),
            "steady_passes_per_s": round(steady_passes),
            "probe_round_trip_us": round(probe_us, 1),
            "probe_backend_cpu_us": None if probe_cpu_us is None else round(probe_cpu_us, 1),
            "rate": args.rate,
            "rounds": args.rounds,
            "seconds": args.seconds,
        }
        if "pg" in args.cases:
            results.update(postgres_broker_case(admin, base, args))
    finally:
        if broker is not None:
            broker.close()
        channel = pika.BlockingConnection(pika.URLParameters(RABBITMQ_URL)).channel()
        for name in (queue, dq_name(queue), xq_name(queue)):
            channel.queue_delete(name)
        channel.connection.close()
        for name in schemas.values():
            admin.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))
        admin.close()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
