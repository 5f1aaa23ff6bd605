"""Relay benchmark: our relay against raw pika and a naive relay, measured side by side in one run.

    python benchmarks/relay.py [--rows 20000] [--rounds 3] [--retained 1000000] [--scaling-rows 10000]
                               [--naive-rows 2000] [--latency-seconds 5] [--sends 2000] [--quorum | --quorum-only]

Measures, on the same servers:
  1. throughput, in ``--rounds`` interleaved rounds (medians reported): raw pika publishing
     with pipelined confirms through ``basic_publish`` (the baseline, no database); raw pika
     writing many messages' frames per socket write (the publish limit of pika itself, for
     reference); our relay draining a backlog of ``--rows`` outbox rows;
  2. the same drain beside ``--retained`` published rows kept in the table, interleaved with a
     drain of an outbox that keeps none (``retained_ratio``), and the Postgres side of it alone
     (the relay's statements with no publish between, ``retained_db_ratio``);
  3. 1, 2 and 4 relays (one process each) draining ``--scaling-rows`` rows of one queue, and of
     four queues;
  4. a naive relay: claim rows, publish each with a blocking confirm, mark them;
  5. commit-to-confirmed latency p50/p99 at a steady 500 messages/s (the relay finds new rows by itself: no NOTIFY since migration 6);
  6. ``send()`` inside an open transaction vs Dramatiq's own ``send()`` with confirm_delivery=True;
  7. with ``--quorum`` (or only this, ``--quorum-only``): throughput to a quorum queue on a 3-node
     cluster, our relay vs raw pika with pipelined confirms to a quorum queue declared with the
     same arguments, both through the same node, interleaved rounds (``quorum_ratio_to_baseline``).
     The cluster is three nodes started from the machine's RabbitMQ by ``tests/rabbitmq_nodes.py``
     (root needed), or the nodes named in ``QUORUM_RABBITMQ_URLS`` (``;``-separated).
Backlogs are built with one ``INSERT ... SELECT generate_series`` each (bodies the size and
shape ``send()`` writes, one message id each).  Everything created is dropped at the end.
The last line printed is one JSON object with the figures and ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import statistics
import sys
import threading
import time
import uuid
from typing import Any

import dramatiq
import pika
import psycopg
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.common import dq_name, xq_name
from pika import frame, spec
from psycopg import sql

from dramatiq_reliable import OutboxBroker, Relay, _sql, migrate

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


def fast_fill(schema: str, template: bytes, queues: list[str], rows: int, *, published: bool = False) -> None:
    """Insert ``rows`` rows in one statement: ``template`` with a fresh message id in each.

    Rows go round-robin to ``queues``; ``published`` rows are marked published an hour ago
    (retained rows, as ``on_published="mark"`` leaves them).
    """
    message_id = json.loads(template)["message_id"]
    query = sql.SQL(
        "INSERT INTO {}.outbox (message_id, queue_name, actor_name, body, published_at) "
        "SELECT g.mid, (%(queues)s::text[])[1 + g.n %% %(count)s], 'bench_actor', "
        "convert_to(replace(%(template)s, %(old)s, g.mid), 'UTF8'), "
        "CASE WHEN %(published)s THEN now() - interval '1 hour' END "
        "FROM (SELECT n, gen_random_uuid()::text AS mid FROM generate_series(1, %(rows)s) AS n) AS g"
    ).format(sql.Identifier(schema))
    with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
        conn.execute(
            query,
            {
                "queues": queues,
                "count": len(queues),
                "template": template.decode(),
                "old": message_id,
                "published": published,
                "rows": rows,
            },
        )
        # Retained rows in production have long been vacuumed; without this the autovacuum of
        # a freshly built million rows runs during the measurement and is what it measures.
        command = "VACUUM (ANALYZE) {}.outbox" if published else "ANALYZE {}.outbox"
        conn.execute(sql.SQL(command).format(sql.Identifier(schema)))


def raw_pika(
    queue: str, bodies: list[bytes], window: int, *, url: str = RABBITMQ_URL, arguments: dict[str, Any] | None = None
) -> float:
    """Publish with pipelined confirms using pika directly; return messages/s."""
    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    channel.queue_declare(queue, durable=True, arguments=arguments)
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


def raw_frames(
    queue: str,
    bodies: list[bytes],
    window: int,
    *,
    per_write: int = 128,
    url: str = RABBITMQ_URL,
    arguments: dict[str, Any] | None = None,
) -> float:
    """As :func:`raw_pika`, but ``per_write`` messages' frames go out in one socket write.

    ``basic_publish`` writes each of a message's three frames on its own; this is the rate pika
    can reach on these servers when that cost is taken away (our relay writes this way).
    """
    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    channel.queue_declare(queue, durable=True, arguments=arguments)
    impl = channel._impl
    outstanding: set[int] = set()
    selected: list[bool] = []

    def on_confirm(frame_: Any) -> None:
        tag, multiple = frame_.method.delivery_tag, frame_.method.multiple
        for t in [t for t in outstanding if t <= tag] if multiple else [tag]:
            outstanding.discard(t)

    impl.confirm_delivery(on_confirm, callback=lambda _f: selected.append(True))
    connection._flush_output(lambda: bool(selected))
    number = impl.channel_number
    method = frame.Method(number, spec.Basic.Publish(exchange="", routing_key=queue, mandatory=True)).marshal()
    started = time.perf_counter()
    tag = 0
    for offset in range(0, len(bodies), window):
        parts: list[bytes] = []
        for index, body in enumerate(bodies[offset : offset + window], 1):
            tag += 1
            outstanding.add(tag)
            properties = spec.BasicProperties(delivery_mode=2, message_id=str(tag))
            parts += (method, frame.Header(number, len(body), properties).marshal(), frame.Body(number, body).marshal())
            if index % per_write == 0:
                impl.connection._output_marshaled_frames([b"".join(parts)])
                parts = []
                connection.process_data_events(0)
        if parts:
            impl.connection._output_marshaled_frames([b"".join(parts)])
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


def drain_rate(broker: OutboxBroker, queues: list[str], batch_size: int) -> float:
    """Our relay drains the schema's backlog; return rows/s (connecting and declaring not timed)."""
    relay = Relay.from_broker(broker, batch_size=batch_size)
    try:
        ready(relay, queues)
        started = time.perf_counter()
        published = relay.drain()
        return published / (time.perf_counter() - started)
    finally:
        relay.publisher.close()


def db_batch_ms(schema: str, batch_size: int) -> float:
    """Drain the backlog with the relay's own statements and no RabbitMQ; return ms per batch.

    The Postgres side of a pass (settings, claim, marks, commit) without the publish between,
    so retained rows' cost shows without RabbitMQ's noise.
    """
    batches = 0
    with psycopg.connect(DATABASE_URL) as conn:
        started = time.perf_counter()
        while True:
            with conn.transaction():
                conn.execute(
                    _sql.query("outbox_relay_local", schema), {"statement_timeout": "30000", "idle_timeout": "90000"}
                )
                rows = conn.execute(
                    _sql.query("outbox_claim", schema), {"batch_size": batch_size, "max_attempts": 25}
                ).fetchall()
                if not rows:
                    break
                conn.execute(_sql.query("outbox_mark_published", schema), {"ids": [row[0] for row in rows]})
            batches += 1
        return (time.perf_counter() - started) / max(batches, 1) * 1000


def ready(relay: Relay, queues: list[str]) -> None:
    """Connect ``relay`` to both servers and declare ``queues``, so the timing counts draining only."""
    for queue in queues:
        relay.publisher._declarer.declare_queue(queue, ensure=True)
    relay.publisher._open_channel()
    with relay.database.connection() as conn:
        conn.execute("SELECT 1")


def _scaling_relay(schema: str, batch_size: int, queues: list[str], started_: Any, go: Any, results: Any) -> None:
    """One relay process of the scaling figure: connect and declare, wait for the start, drain."""
    broker = OutboxBroker(url=RABBITMQ_URL, database=DATABASE_URL, schema=schema)
    relay = Relay.from_broker(broker, batch_size=batch_size)
    try:
        ready(relay, queues)
        started_.release()
        go.wait()
        started = time.perf_counter()
        published = relay.drain()
        results.put((published, started, time.perf_counter()))
    finally:
        relay.publisher.close()
        broker.close()


def scaling(schema: str, template: bytes, queues: list[str], rows: int, relays: int, batch_size: int) -> float:
    """``relays`` relay processes drain ``rows`` rows spread over ``queues``; return rows/s overall."""
    fast_fill(schema, template, queues, rows)
    context = multiprocessing.get_context("spawn")
    started, go, results = context.Semaphore(0), context.Event(), context.Queue()
    processes = [
        context.Process(target=_scaling_relay, args=(schema, batch_size, queues, started, go, results))
        for _ in range(relays)
    ]
    for process in processes:
        process.start()
    try:
        for _ in processes:
            if not started.acquire(timeout=60):
                raise RuntimeError("a relay process did not start within 60 s")
        go.set()
        outcomes = [results.get(timeout=300) for _ in processes]
    finally:
        for process in processes:
            process.join(30)
            if process.is_alive():
                process.kill()
    published = sum(o[0] for o in outcomes)
    if published != rows:
        raise RuntimeError(f"{relays} relays published {published} of {rows} rows")
    return float(published / (max(o[2] for o in outcomes) - min(o[1] for o in outcomes)))


@contextlib.contextmanager
def quorum_cluster() -> Any:
    """The URLs of a 3-node cluster: ``QUORUM_RABBITMQ_URLS``, or three nodes started here and killed after."""
    given = os.environ.get("QUORUM_RABBITMQ_URLS")
    if given:
        yield given.split(";")
        return
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    import rabbitmq_nodes  # the tests' helper, only for this case

    reason = rabbitmq_nodes.available()
    if reason is not None:
        raise SystemExit(f"cannot start a RabbitMQ cluster here ({reason}); set QUORUM_RABBITMQ_URLS")
    log("   starting three RabbitMQ nodes (about 30 s)")
    with rabbitmq_nodes.cluster(3) as cluster:
        yield cluster.urls


def quorum_case(make: Any, sample: bytes, queue: str, rows: int, rounds: int, batch_size: int) -> dict[str, Any]:
    """Our relay vs raw pika, both to quorum queues through the cluster's first node."""
    from dramatiq_reliable.outbox.queues import QueueSettings

    with quorum_cluster() as urls:
        url = urls[0]  # one node for both: the same hop to the queue's leader (declared from it)
        broker = make(url)
        schema = broker.schema
        quorum_queue = f"{queue}_quorum"
        raw_queue = f"{queue}_quorum_raw"
        arguments = QueueSettings(queue_type="quorum").arguments(raw_queue)
        raw_rates: list[float] = []
        frame_rates: list[float] = []
        our_rates: list[float] = []
        admin = pika.BlockingConnection(pika.URLParameters(url)).channel()
        try:
            for round_ in range(rounds):
                raw_rates.append(raw_pika(raw_queue, [sample] * rows, batch_size, url=url, arguments=arguments))
                frame_rates.append(raw_frames(raw_queue, [sample] * rows, batch_size, url=url, arguments=arguments))
                fast_fill(schema, sample, [quorum_queue], rows)
                our_rates.append(drain_rate(broker, [quorum_queue], batch_size))
                admin.queue_purge(quorum_queue)
                log(
                    f"   round {round_ + 1}: raw pika {raw_rates[-1]:,.0f}, raw frames {frame_rates[-1]:,.0f}, "
                    f"our relay {our_rates[-1]:,.0f} msg/s"
                )
        finally:
            for name in (quorum_queue, dq_name(quorum_queue), xq_name(quorum_queue), raw_queue):
                with contextlib.suppress(pika.exceptions.AMQPError):
                    admin.queue_delete(name)
            admin.connection.close()
    ratios = [o / b for o, b in zip(our_rates, raw_rates, strict=True)]
    return {
        "quorum_relay_rows_per_s": round(statistics.median(our_rates)),
        "quorum_baseline_rows_per_s": round(statistics.median(raw_rates)),
        "quorum_ratio_to_baseline": round(statistics.median(ratios), 3),
        "quorum_ratio_to_baseline_rounds": [round(r, 3) for r in ratios],
        "quorum_frames_baseline_rows_per_s": round(statistics.median(frame_rates)),
        "quorum_ratio_to_frames_baseline": round(
            statistics.median(o / b for o, b in zip(our_rates, frame_rates, strict=True)), 3
        ),
    }


def new_schema(prefix: str) -> str:
    schema = f"{prefix}_{uuid.uuid4().hex[:8]}"
    migrate(DATABASE_URL, schema=schema)
    return schema


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--retained", type=int, default=1_000_000, help="0 skips the retained-rows figure")
    parser.add_argument("--scaling-rows", type=int, default=10_000, help="0 skips the scaling figure")
    parser.add_argument("--naive-rows", type=int, default=2_000)
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--latency-seconds", type=float, default=5.0)
    parser.add_argument("--rate", type=int, default=500)
    parser.add_argument("--sends", type=int, default=2_000)
    parser.add_argument("--prefix", default="perfrelay", help="schema and queue name prefix")
    parser.add_argument("--quorum", action="store_true", help="also measure quorum queues on a 3-node cluster")
    parser.add_argument("--quorum-only", action="store_true", help="measure only the quorum case")
    args = parser.parse_args()

    tag = uuid.uuid4().hex[:8]
    queue = f"{args.prefix}_{tag}"
    scaling_queues = [f"{args.prefix}_{tag}_s{i}" for i in range(4)]
    schemas: list[str] = []
    admin = pika.BlockingConnection(pika.URLParameters(RABBITMQ_URL)).channel()
    brokers: list[OutboxBroker] = []

    def outbox(prefix: str, url: str = RABBITMQ_URL, **options: Any) -> OutboxBroker:
        schemas.append(new_schema(prefix))
        made = OutboxBroker(url=url, database=DATABASE_URL, schema=schemas[-1], **options)
        brokers.append(made)
        return made

    results: dict[str, Any] = {}
    try:
        broker = outbox(f"{args.prefix}_b")
        schema = schemas[-1]
        actor = dramatiq.actor(lambda n: None, actor_name="bench_actor", queue_name=queue, broker=broker)
        # Bodies of the same size and shape our relay publishes, for a like-for-like baseline.
        sample = actor.message(0).encode()

        if args.quorum or args.quorum_only:
            log(
                f"quorum (7.): quorum queues on a 3-node cluster, {args.rounds} interleaved rounds of {args.rows} messages"
            )
            results |= quorum_case(
                lambda url: outbox(f"{args.prefix}_q", url, queue_type="quorum"),
                sample,
                queue,
                args.rows,
                args.rounds,
                args.batch_size,
            )
            log(
                f"   medians: raw pika {results['quorum_baseline_rows_per_s']:,}, ours "
                f"{results['quorum_relay_rows_per_s']:,} msg/s, ratio {results['quorum_ratio_to_baseline']}"
            )
        if args.quorum_only:
            results |= {"batch_size": args.batch_size, "rows": args.rows, "rounds": args.rounds}
        else:
            log(f"1. throughput, {args.rounds} interleaved rounds of {args.rows} messages of {len(sample)} bytes")
            raw_rates: list[float] = []
            frame_rates: list[float] = []
            our_rates: list[float] = []
            for round_ in range(args.rounds):
                raw_rates.append(raw_pika(f"{queue}_raw", [sample] * args.rows, args.batch_size))
                frame_rates.append(raw_frames(f"{queue}_raw", [sample] * args.rows, args.batch_size))
                fast_fill(schema, sample, [queue], args.rows)
                our_rates.append(drain_rate(broker, [queue], args.batch_size))
                admin.queue_purge(queue)
                log(
                    f"   round {round_ + 1}: raw pika {raw_rates[-1]:,.0f}, raw frames {frame_rates[-1]:,.0f}, "
                    f"our relay {our_rates[-1]:,.0f} msg/s"
                )
            baseline = statistics.median(raw_rates)
            frames_baseline = statistics.median(frame_rates)
            ours = statistics.median(our_rates)
            ratios = [o / b for o, b in zip(our_rates, raw_rates, strict=True)]
            results |= {
                "relay_rows_per_s": round(ours),
                "baseline_rows_per_s": round(baseline),
                "ratio_to_baseline": round(statistics.median(ratios), 3),
                "ratio_to_baseline_rounds": [round(r, 3) for r in ratios],
                "frames_baseline_rows_per_s": round(frames_baseline),
                "ratio_to_frames_baseline": round(
                    statistics.median(o / b for o, b in zip(our_rates, frame_rates, strict=True)), 3
                ),
            }
            log(f"   medians: raw pika {baseline:,.0f}, raw frames {frames_baseline:,.0f}, ours {ours:,.0f} msg/s")

            if args.retained:
                log(f"2. the same drain beside {args.retained:,} retained published rows, {args.rounds} rounds")
                kept = outbox(f"{args.prefix}_k")
                started = time.perf_counter()
                fast_fill(schemas[-1], sample, [queue], args.retained, published=True)
                log(f"   built {args.retained:,} published rows in {time.perf_counter() - started:.1f} s")
                empty_rates: list[float] = []
                kept_rates: list[float] = []
                empty_ms: list[float] = []
                kept_ms: list[float] = []
                for round_ in range(args.rounds):
                    fast_fill(schema, sample, [queue], args.rows)
                    empty_rates.append(drain_rate(broker, [queue], args.batch_size))
                    fast_fill(schemas[-1], sample, [queue], args.rows)
                    kept_rates.append(drain_rate(kept, [queue], args.batch_size))
                    admin.queue_purge(queue)
                    fast_fill(schema, sample, [queue], args.rows)
                    empty_ms.append(db_batch_ms(schema, args.batch_size))
                    fast_fill(schemas[-1], sample, [queue], args.rows)
                    kept_ms.append(db_batch_ms(schemas[-1], args.batch_size))
                    log(
                        f"   round {round_ + 1}: none retained {empty_rates[-1]:,.0f}, retained {kept_rates[-1]:,.0f} msg/s; "
                        f"Postgres only {empty_ms[-1]:.1f} vs {kept_ms[-1]:.1f} ms a batch"
                    )
                results |= {
                    "retained_rows": args.retained,
                    "retained_rows_per_s": round(statistics.median(kept_rates)),
                    "retained_none_rows_per_s": round(statistics.median(empty_rates)),
                    "retained_ratio": round(
                        statistics.median(k / e for k, e in zip(kept_rates, empty_rates, strict=True)), 3
                    ),
                    # Time per batch, so the ratio is none over retained (>= 0.9 means flat), like the others.
                    "retained_db_batch_ms": round(statistics.median(kept_ms), 2),
                    "retained_none_db_batch_ms": round(statistics.median(empty_ms), 2),
                    "retained_db_ratio": round(
                        statistics.median(e / k for e, k in zip(empty_ms, kept_ms, strict=True)), 3
                    ),
                }

            if args.scaling_rows:
                log(f"3. 1, 2 and 4 relay processes draining {args.scaling_rows} rows")
                for label, queues in (("one_queue", scaling_queues[:1]), ("four_queues", scaling_queues)):
                    rates = [
                        scaling(schema, sample, queues, args.scaling_rows, relays, args.batch_size)
                        for relays in (1, 2, 4)
                    ]
                    for name in queues:
                        admin.queue_purge(name)
                    log(
                        f"   {label}: "
                        + ", ".join(f"{n} relays {r:,.0f} msg/s" for n, r in zip((1, 2, 4), rates, strict=True))
                    )
                    results[f"scaling_{label}"] = [round(r) for r in rates]
                    results[f"scaling_{label}_ratio"] = [round(r / rates[0], 2) for r in rates]

            log(f"4. naive relay, one blocking confirm per row, {args.naive_rows} rows")
            fill_outbox(broker, actor, args.naive_rows)
            naive = naive_relay(DATABASE_URL, schema, args.naive_rows, args.batch_size)
            log(f"   {naive:,.0f} rows/s")
            admin.queue_purge(queue)

            log(f"5. latency at {args.rate} msg/s for {args.latency_seconds}s, the relay waking by itself")
            p50, p99, lost = latency(broker, actor, queue, args.latency_seconds, args.rate)
            log(f"   p50 {p50:.2f} ms, p99 {p99:.2f} ms, undelivered {lost}")
            admin.queue_purge(queue)

            log(f"6. send() cost, {args.sends} sends")
            outbox_us, direct_us = send_costs(broker, queue, args.sends)
            log(f"   outbox send in a transaction {outbox_us:.0f} us, Dramatiq confirmed send {direct_us:.0f} us")

            results |= {
                "naive_rows_per_s": round(naive),
                "ratio_to_naive": round(ours / naive, 2),
                "latency_p50_ms": round(p50, 2),
                "latency_p99_ms": round(p99, 2),
                "latency_undelivered": lost,
                "outbox_send_us": round(outbox_us, 1),
                "confirmed_send_us": round(direct_us, 1),
                "send_speedup_vs_confirmed_send": round(direct_us / outbox_us, 2),
                "batch_size": args.batch_size,
                "rows": args.rows,
                "rounds": args.rounds,
            }
    finally:
        for made in brokers:
            made.close()
        for name in (queue, dq_name(queue), xq_name(queue), f"{queue}_raw", *scaling_queues):
            for each in {name, dq_name(name), xq_name(name)}:
                with contextlib.suppress(pika.exceptions.AMQPError):
                    admin.queue_delete(each)
        admin.connection.close()
        with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
            for made_schema in schemas:
                conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(made_schema)))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
