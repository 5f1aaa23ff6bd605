"""Relay benchmark: our relay against raw pika and a naive relay, measured side by side in one run.

    python benchmarks/relay.py [--rows 50000] [--naive-rows 5000] [--latency-seconds 10] [--sends 5000]

Measures, on the same servers and in this order:
  1. raw pika publishing with pipelined confirms (the physical baseline, no database);
  2. a naive relay: claim rows, publish each with a blocking confirm, mark them;
  3. our relay draining a backlog of ``--rows`` outbox rows;
  4. commit-to-confirmed latency p50/p99 at a steady 500 messages/s with NOTIFY wake-up;
  5. ``send()`` inside an open transaction vs Dramatiq's own ``send()`` with confirm_delivery=True.
The last line printed is one JSON object with the figures and ratios.
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

from dramatiq_reliable import OutboxBroker, Relay, migrate

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
RABBITMQ_URL = os.environ.get("RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")


def log(text: str) -> None:
    print(text, flush=True)


def fill_outbox(broker: OutboxBroker, actor: Any, rows: int) -> None:
    """Insert ``rows`` outbox rows through send(), committed in chunks."""
    for start in range(0, rows, 5000):
        with broker.transaction():
            for i in range(start, min(rows, start + 5000)):
                actor.send(i)


def raw_pika(queue: str, bodies: list[bytes], window: int) -> float:
    """Publish with pipelined confirms using pika directly; return messages/s."""
    connection = pika.BlockingConnection(pika.URLParameters(RABBITMQ_URL))
    channel = connection.channel()
    channel.queue_declare(queue, durable=True)
    impl = channel._impl
    outstanding: set[int] = set()
    selected: list[bool] = []

    def on_confirm(frame: Any) -> None:
        tag, multiple = frame.method.delivery_tag, frame.method.multiple
        for t in [t for t in outstanding if t <= tag] if multiple else [tag]:
            outstanding.discard(t)

    impl.confirm_delivery(on_confirm, callback=lambda _f: selected.append(True))
    connection._flush_output(lambda: bool(selected))
    started = time.perf_counter()
    tag = 0
    for offset in range(0, len(bodies), window):
        for body in bodies[offset : offset + window]:
            tag += 1
            outstanding.add(tag)
            impl.basic_publish("", queue, body, pika.BasicProperties(delivery_mode=2), mandatory=True)
        connection._flush_output(lambda: not outstanding)
    elapsed = time.perf_counter() - started
    channel.queue_delete(queue)
    connection.close()
    return len(bodies) / elapsed


def naive_relay(database_url: str, schema: str, rows: int, batch: int) -> float:
    """Claim a batch, publish each row with a blocking confirm, mark, commit; return rows/s."""
    connection = pika.BlockingConnection(pika.URLParameters(RABBITMQ_URL))
    channel = connection.channel()
    channel.confirm_delivery()
    claim = sql.SQL(
        "SELECT id, queue_name, body FROM {}.outbox WHERE published_at IS NULL ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED"
    ).format(sql.Identifier(schema))
    mark = sql.SQL("UPDATE {}.outbox SET published_at = now() WHERE id = ANY(%s)").format(sql.Identifier(schema))
    done = 0
    started = time.perf_counter()
    with psycopg.connect(database_url) as conn:
        while done < rows:
            with conn.transaction():
                claimed = conn.execute(claim, (batch,)).fetchall()
                if not claimed:
                    break
                for _id, queue, body in claimed:
                    channel.basic_publish("", queue, bytes(body), pika.BasicProperties(delivery_mode=2), mandatory=True)
                conn.execute(mark, ([r[0] for r in claimed],))
            done += len(claimed)
    elapsed = time.perf_counter() - started
    connection.close()
    return done / elapsed


def latency(broker: OutboxBroker, actor: Any, queue: str, seconds: float, rate: int) -> tuple[float, float, int]:
    """Steady ``rate`` sends/s, each committed alone; return p50 and p99 commit-to-delivered ms."""
    committed: dict[str, float] = {}
    delivered: dict[str, float] = {}
    relay = Relay.from_broker(broker, poll_interval_ms=1000)
    relay_thread = threading.Thread(target=relay.run, daemon=True)
    relay_thread.start()
    consumer_ready = threading.Event()
    stop = threading.Event()

    def consume() -> None:
        connection = pika.BlockingConnection(pika.URLParameters(RABBITMQ_URL))
        channel = connection.channel()
        channel.basic_qos(prefetch_count=1000)
        consumer_ready.set()
        for method, _props, body in channel.consume(queue, auto_ack=True, inactivity_timeout=0.05):
            if method is not None:
                delivered[json.loads(body)["message_id"]] = time.perf_counter()
            if stop.is_set():
                break
        channel.cancel()
        connection.close()

    RabbitmqBroker(url=RABBITMQ_URL, middleware=[]).declare_queue(queue, ensure=True)
    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    consumer_ready.wait(10)
    time.sleep(0.5)  # let the relay's LISTEN settle before the measured window
    interval = 1 / rate
    next_at = time.perf_counter()
    end = next_at + seconds
    while next_at < end:
        delay = next_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        message = actor.send(0)  # unbound: inserted and committed before send() returns
        committed[message.message_id] = time.perf_counter()
        next_at += interval
    deadline = time.perf_counter() + 30
    while len(delivered) < len(committed) and time.perf_counter() < deadline:
        time.sleep(0.05)
    stop.set()
    relay.stop()
    relay_thread.join(30)
    consumer.join(30)
    samples = sorted((delivered[m] - committed[m]) * 1000 for m in committed if m in delivered)
    lost = len(committed) - len(samples)
    p50 = statistics.median(samples)
    p99 = samples[min(len(samples) - 1, int(len(samples) * 0.99))]
    return p50, p99, lost


def send_costs(broker: OutboxBroker, queue: str, sends: int) -> tuple[float, float]:
    """Microseconds per send: outbox send inside one transaction vs Dramatiq's confirmed send."""
    outbox_actor = dramatiq.actor(lambda n: None, actor_name="bench_send_outbox", queue_name=queue, broker=broker)
    started = time.perf_counter()
    with broker.transaction():
        for i in range(sends):
            outbox_actor.send(i)
    outbox_us = (time.perf_counter() - started) / sends * 1e6

    confirmed = RabbitmqBroker(url=RABBITMQ_URL, confirm_delivery=True, middleware=[])
    direct_actor = dramatiq.actor(lambda n: None, actor_name="bench_send_direct", queue_name=queue, broker=confirmed)
    direct_actor.send(-1)  # connect and declare outside the timing
    started = time.perf_counter()
    for i in range(sends):
        direct_actor.send(i)
    direct_us = (time.perf_counter() - started) / sends * 1e6
    confirmed.close()
    return outbox_us, direct_us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=50_000)
    parser.add_argument("--naive-rows", type=int, default=5_000)
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--latency-seconds", type=float, default=10.0)
    parser.add_argument("--rate", type=int, default=500)
    parser.add_argument("--sends", type=int, default=5_000)
    args = parser.parse_args()

    schema = f"bench_{uuid.uuid4().hex[:8]}"
    queue = f"bench_{uuid.uuid4().hex[:8]}"
    migrate(DATABASE_URL, schema=schema)
    broker = OutboxBroker(url=RABBITMQ_URL, database=DATABASE_URL, schema=schema)
    actor = dramatiq.actor(lambda n: None, actor_name="bench_actor", queue_name=queue, broker=broker)
    admin = pika.BlockingConnection(pika.URLParameters(RABBITMQ_URL)).channel()
    results: dict[str, Any] = {}
    try:
        # Bodies of the same size our relay publishes, for a like-for-like baseline.
        sample = actor.message(0).encode()
        log(f"1. raw pika, pipelined confirms, {args.rows} messages of {len(sample)} bytes")
        baseline = raw_pika(f"{queue}_raw", [sample] * args.rows, args.batch_size)
        log(f"   {baseline:,.0f} msg/s")

        log(f"2. naive relay, one blocking confirm per row, {args.naive_rows} rows")
        fill_outbox(broker, actor, args.naive_rows)
        declarer = RabbitmqBroker(url=RABBITMQ_URL, middleware=[])
        declarer.declare_queue(queue, ensure=True)  # as our relay does, so both publish to the same queues
        declarer.close()
        naive = naive_relay(DATABASE_URL, schema, args.naive_rows, args.batch_size)
        log(f"   {naive:,.0f} rows/s")
        admin.queue_purge(queue)

        log(f"3. our relay draining a backlog of {args.rows} rows")
        fill_outbox(broker, actor, args.rows)
        relay = Relay.from_broker(broker, batch_size=args.batch_size)
        started = time.perf_counter()
        published = relay.drain()
        ours = published / (time.perf_counter() - started)
        relay.publisher.close()
        log(f"   {ours:,.0f} rows/s ({published} rows)")
        admin.queue_purge(queue)

        log(f"4. latency at {args.rate} msg/s for {args.latency_seconds}s, NOTIFY wake-up")
        p50, p99, lost = latency(broker, actor, queue, args.latency_seconds, args.rate)
        log(f"   p50 {p50:.2f} ms, p99 {p99:.2f} ms, undelivered {lost}")
        admin.queue_purge(queue)

        log(f"5. send() cost, {args.sends} sends")
        outbox_us, direct_us = send_costs(broker, queue, args.sends)
        log(f"   outbox send in a transaction {outbox_us:.0f} us, Dramatiq confirmed send {direct_us:.0f} us")

        results = {
            "relay_rows_per_s": round(ours),
            "baseline_rows_per_s": round(baseline),
            "naive_rows_per_s": round(naive),
            "ratio_to_baseline": round(ours / baseline, 3),
            "ratio_to_naive": round(ours / naive, 2),
            "latency_p50_ms": round(p50, 2),
            "latency_p99_ms": round(p99, 2),
            "latency_undelivered": lost,
            "outbox_send_us": round(outbox_us, 1),
            "confirmed_send_us": round(direct_us, 1),
            "send_speedup_vs_confirmed_send": round(direct_us / outbox_us, 2),
            "batch_size": args.batch_size,
            "rows": args.rows,
        }
    finally:
        broker.close()
        for name in (queue, dq_name(queue), xq_name(queue), f"{queue}_raw"):
            admin.queue_delete(name)
        admin.connection.close()
        with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
