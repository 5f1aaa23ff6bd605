"""Scheduler and singleton benchmark: how fast due ticks reach the outbox, and what a lease costs.

    python benchmarks/scheduler.py [--schedules 10000] [--messages 2000] [--rounds 3] [--loop-rounds 2]
                                   [--lead-ms 2000]

1. ``--schedules`` schedules (every 20 s) are all due at the same second F.  One, then three scheduler loops
   (the library's ``Scheduler``, each in a process of its own so the GIL is not what is measured)
   claim and fire them; each run in a fresh schema.  Reported: ticks/s (schedules / seconds from
   F to the last loop done) and the lag from F to the tick's outbox row ``created_at`` (p50/p99;
   ``created_at`` is the firing transaction's start), and ``lag_commit_*``: from F to the end of
   the commit that made the tick visible to a relay (what a consumer waits for; a pass's
   ticks all become visible at its commit).  Every tick must reach the outbox exactly once.
   ``--loop-rounds`` rounds alternate 1 loop and 3 loops; medians are reported, with the
   ``_spread`` [min, max] of the p99 over the rounds.  The schedules are ``overlap="allow"``.
   Each round runs twice, interleaved: with ``lead_ms=0`` (the baseline: ticks written once
   due, as before firing ahead) and with ``--lead-ms`` (ticks written up to that long before F,
   due at F: the loops start ``--lead-ms`` before F).  For a tick written ahead both lags are
   taken to when its row is due and visible: the later of its commit (or ``created_at``) and F.
   The keys without a suffix are the runs with the lead; ``_lead0`` are the baseline's.
   With ``--relay`` a ``Relay`` process publishes to RabbitMQ (``RABBITMQ_URL``) during each run,
   started with the loops: ``lag_publish_p99_ms`` is F to the row's ``published_at`` (the relay
   transaction's start, which claims and publishes the batch: a consumer-visible lag, short by
   that batch's publish and confirm).  This is the figure a consumer sees.  ``--relays N`` runs N
   relay processes (SKIP LOCKED shares the rows).
   With ``--target queue`` the loops write into a ``PostgresBroker`` queue table instead (no
   relay): ``lag_*`` are taken to when the row is visible to consumers (the later of
   ``enqueued_at``, the firing transaction's start, and F), and ``--consumers N`` runs N processes
   each holding one ``PostgresBroker`` consumer that claims (and holds, unacked) every tick:
   ``lag_claim_p99_ms`` is F to the claiming transaction's start, the consumer-visible lag.
2. One actor doing one INSERT, run ``--messages`` times by a one-thread worker on a StubBroker,
   with ``singleton=True`` under the ``Singleton`` middleware and, in the same run, as a plain
   actor, interleaved over ``--rounds`` rounds (plain, singleton, plain, ...: both see the same
   machine load); ``singleton_ratio`` is the median over the rounds of singleton throughput /
   plain throughput (1.0 = free), ``singleton_ratio_spread`` its [min, max].  A third actor runs
   the middleware's acquire and release statements itself, on its own connection, around the
   same INSERT: ``singleton_ceiling_ratio`` is what no middleware taking a lease row can beat.
   Two more actors run under transactional ``Idempotency`` (the INSERT on ``job_connection()``),
   one a singleton (its key taken in the job's transaction), one not, interleaved in the same
   rounds: ``singleton_txn_ratio`` (and ``_spread``) is the first's throughput over the second's.
   ``--singleton-only`` runs this part alone.

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
import pika
import psycopg
from dramatiq.brokers.stub import StubBroker
from dramatiq.middleware import Callbacks
from psycopg import sql
from psycopg.rows import dict_row

from dramatiq_reliable import Database, Idempotency, PostgresBroker, Relay, Singleton, _sql, job_connection, migrate
from dramatiq_reliable.scheduler import Registry, Schedule, Scheduler

# Long enough that the tick after F is not due before every loop is done, short enough to wait for.
_INTERVAL_S = 20
DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
RABBITMQ_URL = os.environ.get("RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")


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


# A consumer's lease in the queue-target runs: the claim moves a row's available_at to the lease's
# end, so the claim's time is available_at less this (long enough that no heartbeat renews it).
_CLAIM_LEASE_MS = 3_600_000


def _loop(schema: str, start_at: float, done: Any, lead_ms: int, target: str) -> None:
    """One scheduler process: warm up, wait for F (less the lead), then fire until nothing is left to claim."""
    scheduler = Scheduler(
        database=Database(url=DATABASE_URL, max_size=2),
        schema=schema,
        registry=Registry(),
        lead_ms=lead_ms,
        target=target,  # type: ignore[arg-type]
    )
    scheduler.tick_once()  # opens the pool and checks the schema; nothing is due yet
    time.sleep(max(0.0, start_at - time.time()))
    empty = 0
    visible: list[tuple[float, int]] = []  # (time the pass's commit returned, ticks it fired)
    while empty < 2:
        result = scheduler.tick_once()
        visible.append((time.time(), result.fired))
        empty = empty + 1 if result.claimed == 0 else 0
    done.put((time.time(), visible))
    scheduler.close()


def _consumer(schema: str, queue: str, stop: Any, prefetch: int) -> None:
    """A PostgresBroker consumer process claiming the run's ticks, and holding them, until ``stop`` is set."""
    broker = PostgresBroker(database=DATABASE_URL, schema=schema, lease_ms=_CLAIM_LEASE_MS)
    broker.declare_queue(queue)
    consumer = broker.consume(queue, prefetch=prefetch, timeout=100)
    while not stop.is_set():
        next(consumer)
    consumer.close()
    broker.close()


def _relay(schema: str, stop: Any) -> None:
    """A relay process publishing the run's ticks to RabbitMQ until ``stop`` is set."""
    relay = Relay(rabbitmq_url=RABBITMQ_URL, database=Database(url=DATABASE_URL, max_size=2), schema=schema)
    threading.Thread(target=lambda: (stop.wait(), relay.stop()), daemon=True).start()
    relay.run()


def _delete_queue(queue: str) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(RABBITMQ_URL))
    try:
        channel = connection.channel()
        for name in (queue, f"{queue}.DQ", f"{queue}.XQ"):
            channel.queue_delete(name)
    finally:
        connection.close()


def _lags_when_settled(schema: str, table: str, unsettled: str, moment: str, *params: float) -> list[float]:
    """Wait (up to 300 s) until no row of ``table`` is ``unsettled``, then each row's ``moment``
    less F (the last of ``params``), in ms.  ``unsettled`` and ``moment`` are SQL of this file's own."""
    with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
        count = sql.SQL("SELECT count(*) FROM {} WHERE {}").format(sql.Identifier(schema, table), sql.SQL(unsettled))
        deadline = time.monotonic() + 300
        while conn.execute(count).fetchone()[0] and time.monotonic() < deadline:  # type: ignore[index]
            time.sleep(0.1)
        query = sql.SQL("SELECT extract(epoch FROM {}) - %s FROM {}").format(
            sql.SQL(moment), sql.Identifier(schema, table)
        )
        return [float(r[0]) * 1000 for r in conn.execute(query, params).fetchall()]


def bench_loops(
    schedules: int, loops: int, lead_ms: int, relays: int = 0, target: str = "outbox", consumers: int = 0
) -> dict[str, float]:
    schema = _schema()
    queue = f"{schema}_q"
    table = "outbox" if target == "outbox" else "queue"
    try:
        migrate(DATABASE_URL, schema=schema)
        registry = Registry()
        for n in range(schedules):
            registry.add(
                Schedule(
                    name=f"s{n}",
                    actor_name="tick",
                    queue_name=queue,
                    every_ms=int(_INTERVAL_S * 1000),
                    overlap="allow",
                )
            )
        Scheduler(database=DATABASE_URL, schema=schema, registry=registry).sync()
        with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
            row = conn.execute("SELECT extract(epoch FROM clock_timestamp())").fetchone()
            # Interval ticks fall on multiples of the interval: F is the first one at least 2 s away.
            lead_s = lead_ms / 1000
            fire_at = float(math.ceil((float(row[0]) + 2 + lead_s) / _INTERVAL_S) * _INTERVAL_S)  # type: ignore[index]
            conn.execute(
                sql.SQL("UPDATE {} SET next_fire_at = to_timestamp(%s)").format(sql.Identifier(schema, "schedules")),
                (fire_at,),
            )
        context = multiprocessing.get_context("spawn")
        done = context.Queue()
        processes = [
            context.Process(target=_loop, args=(schema, fire_at - lead_s, done, lead_ms, target)) for _ in range(loops)
        ]
        stop_relay = context.Event()
        relayers = [context.Process(target=_relay, args=(schema, stop_relay)) for _ in range(relays)]
        relayers += [
            context.Process(target=_consumer, args=(schema, queue, stop_relay, schedules)) for _ in range(consumers)
        ]
        for process in [*processes, *relayers]:
            process.start()
        reports = [done.get(timeout=600) for _ in processes]
        for process in processes:
            process.join()
        publish_lags: list[float] = []
        claim_lags: list[float] = []
        if consumers:  # claimed at the lease's start: available_at less the lease
            claim_lags = _lags_when_settled(
                schema,
                "queue",
                "lease IS NULL",
                "available_at - %s * interval '1 millisecond'",
                _CLAIM_LEASE_MS,
                fire_at,
            )
        elif relayers:
            publish_lags = _lags_when_settled(schema, "outbox", "published_at IS NULL", "published_at", fire_at)
        if relayers:
            stop_relay.set()
            for relayer in relayers:
                relayer.join(timeout=30)
        finished = [end for end, _ in reports]
        # A tick written ahead is visible to a relay at the later of its commit and its due time F.
        commit_lags = [
            (max(at, fire_at) - fire_at) * 1000 for _, passes in reports for at, fired in passes for _ in range(fired)
        ]
        # Visible at the later of the firing transaction's start and F: a queue row written ahead
        # is due at F, and one written once due at its enqueued_at (its available_at moves when
        # a consumer claims it, so it is not read here).
        visible = (
            "greatest(created_at, available_at)" if table == "outbox" else "greatest(enqueued_at, to_timestamp(%s))"
        )
        with psycopg.connect(DATABASE_URL) as conn:
            lags = [
                float(r[0]) * 1000
                for r in conn.execute(
                    sql.SQL("SELECT extract(epoch FROM {}) - %s FROM {}").format(
                        sql.SQL(visible), sql.Identifier(schema, table)
                    ),
                    (fire_at, fire_at) if table == "queue" else (fire_at,),
                ).fetchall()
            ]
            distinct = conn.execute(
                sql.SQL("SELECT count(DISTINCT message_id) FROM {}").format(sql.Identifier(schema, table))
            ).fetchone()
        if len(lags) != schedules or distinct is None or distinct[0] != schedules:
            raise SystemExit(f"{loops} loop(s) wrote {len(lags)} {table} rows for {schedules} ticks: not exactly once")
        elapsed = max(finished) - (fire_at - lead_s)
        return {
            "ticks_per_s": round(schedules / elapsed, 1),
            "lag_p50_ms": round(statistics.median(lags), 1),
            "lag_p99_ms": round(_percentile(lags, 0.99), 1),
            "lag_commit_p50_ms": round(statistics.median(commit_lags), 1),
            "lag_commit_p99_ms": round(_percentile(commit_lags, 0.99), 1),
            # created_at is the firing transaction's start: this is when the last tick was committed
            "all_fired_ms": round(elapsed * 1000, 1),
            **(
                {
                    "lag_publish_p50_ms": round(statistics.median(publish_lags), 1),
                    "lag_publish_p99_ms": round(_percentile(publish_lags, 0.99), 1),
                }
                if publish_lags
                else {}
            ),
            **(
                {
                    "lag_claim_p50_ms": round(statistics.median(claim_lags), 1),
                    "lag_claim_p99_ms": round(_percentile(claim_lags, 0.99), 1),
                }
                if claim_lags
                else {}
            ),
        }
    finally:
        _drop(schema)
        if relays:
            _delete_queue(queue)


# -- part 2: singleton overhead -----------------------------------------------------------------


def bench_singleton(messages: int, rounds: int) -> dict[str, Any]:
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

        acquire, release = _sql.rendered("singleton_acquire", schema), _sql.rendered("singleton_release_plain", schema)

        def inline(n: int) -> None:
            """The ceiling: the middleware's two statements run by the actor on its own connection."""
            conn = getattr(local, "conn", None)
            if conn is None:
                conn = local.conn = psycopg.connect(DATABASE_URL, autocommit=True)
            params = {"key": "inline", "tokens": f'"{schema}"."singleton_tokens"', "message_id": str(n)}
            row = (
                conn.cursor(row_factory=dict_row)
                .execute(acquire, {**params, "owner": "bench", "lease_ms": 30_000})
                .fetchone()
            )
            if row is None or row["token"] is None:
                raise RuntimeError("the inline lease was held: only one inline run may go at a time")
            conn.execute(insert, (n,))
            conn.execute(release, {"key": "inline", "token": row["token"]})

        def effect_in_job(n: int) -> None:
            job_connection().execute(insert, (n,))

        database = Database(url=DATABASE_URL)
        broker = StubBroker()
        # Singleton before Idempotency, as documented: the key is then taken in the job's transaction.
        broker.add_middleware(Singleton(database=database, schema=schema), before=Callbacks)
        broker.add_middleware(Idempotency(database=database, schema=schema), before=Callbacks)
        off = {"idempotency": "off"}
        plain = dramatiq.actor(effect, actor_name="plain", queue_name="plain", broker=broker, **off)
        single = dramatiq.actor(effect, actor_name="single", queue_name="single", broker=broker, singleton=True, **off)
        ceiling = dramatiq.actor(inline, actor_name="inline", queue_name="inline", broker=broker, **off)
        txn_plain = dramatiq.actor(effect_in_job, actor_name="txn_plain", queue_name="txn_plain", broker=broker)
        txn_single = dramatiq.actor(
            effect_in_job, actor_name="txn_single", queue_name="txn_single", broker=broker, singleton=True
        )
        worker = dramatiq.Worker(broker, worker_threads=1, worker_timeout=10)
        worker.start()
        cases = (
            ("plain", plain),
            ("single", single),
            ("inline", ceiling),
            ("txn_plain", txn_plain),
            ("txn_single", txn_single),
        )
        rates: dict[str, list[float]] = {name: [] for name, _ in cases}
        try:
            for _ in range(rounds):  # interleaved rounds: both sides see the same machine load
                for name, actor in cases:
                    for n in range(messages):
                        actor.send(n)
                    started = time.perf_counter()
                    broker.join(actor.queue_name, fail_fast=True)
                    worker.join()
                    rates[name].append(messages / (time.perf_counter() - started))
        finally:
            worker.stop()
            broker.close()
            database.close()
        plain_rate, single_rate = statistics.median(rates["plain"]), statistics.median(rates["single"])
        ratios = [single / plain for plain, single in zip(rates["plain"], rates["single"], strict=True)]
        ceilings = [inline / plain for plain, inline in zip(rates["plain"], rates["inline"], strict=True)]
        in_txn = [single / plain for plain, single in zip(rates["txn_plain"], rates["txn_single"], strict=True)]
        return {
            "plain_per_s": round(plain_rate, 1),
            "singleton_per_s": round(single_rate, 1),
            "singleton_ratio": round(statistics.median(ratios), 3),
            "singleton_ratio_spread": [round(min(ratios), 3), round(max(ratios), 3)],
            # the acquire and release statements run by the actor itself: no middleware can beat it
            "singleton_ceiling_ratio": round(statistics.median(ceilings), 3),
            # under transactional Idempotency, against the same actor without singleton
            "txn_plain_per_s": round(statistics.median(rates["txn_plain"]), 1),
            "txn_singleton_per_s": round(statistics.median(rates["txn_single"]), 1),
            "singleton_txn_ratio": round(statistics.median(in_txn), 3),
            "singleton_txn_ratio_spread": [round(min(in_txn), 3), round(max(in_txn), 3)],
        }
    finally:
        _drop(schema)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", type=int, default=10_000)
    parser.add_argument("--messages", type=int, default=2_000)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the singleton part")
    parser.add_argument("--loop-rounds", type=int, default=2, help="rounds of 1 loop then 3 loops")
    parser.add_argument("--singleton-only", action="store_true", help="run the singleton part alone")
    parser.add_argument("--lead-ms", type=int, default=2000, help="the scheduler's lead_ms (0 runs only the baseline)")
    parser.add_argument("--relay", action="store_true", help="also measure the lag to the relay's publish")
    parser.add_argument("--relays", type=int, default=1, help="relay processes with --relay")
    parser.add_argument("--skip-singleton", action="store_true", help="only the scheduler part")
    parser.add_argument(
        "--target", choices=("outbox", "queue"), default="outbox", help="where ticks go: outbox or PostgresBroker queue"
    )
    parser.add_argument(
        "--consumers", type=int, default=0, help="PostgresBroker consumer processes with --target queue"
    )
    args = parser.parse_args()
    if args.singleton_only:
        single = bench_singleton(args.messages, args.rounds)
        log(f"singleton actor vs plain (1 worker thread, {args.messages} messages, {args.rounds} rounds)")
        print(json.dumps(single), flush=True)
        return
    leads = [0, args.lead_ms] if args.lead_ms else [0]
    runs: dict[tuple[int, int], list[dict[str, float]]] = {(n, lead): [] for n in (1, 3) for lead in leads}
    for _ in range(args.loop_rounds):
        for loops in (1, 3):
            for lead in leads:  # baseline, lead, baseline, lead, ...: both see the same load
                runs[loops, lead].append(
                    bench_loops(
                        args.schedules,
                        loops,
                        lead,
                        args.relays if args.relay and args.target == "outbox" else 0,
                        args.target,
                        args.consumers if args.target == "queue" else 0,
                    )
                )
                log(
                    f"{loops} scheduler loop(s), lead_ms={lead}: {runs[loops, lead][-1]} (load {os.getloadavg()[0]:.1f})"
                )
    single = {} if args.skip_singleton else bench_singleton(args.messages, args.rounds)
    log(f"singleton actor vs plain (1 worker thread, {args.messages} messages, {args.rounds} rounds): {single}")

    def median(loops: int, key: str, lead: int = args.lead_ms) -> float:
        return round(statistics.median(run[key] for run in runs[loops, lead]), 1)

    def spread(loops: int, key: str, lead: int = args.lead_ms) -> list[float]:
        values = [run[key] for run in runs[loops, lead]]
        return [min(values), max(values)]

    result = {
        "schedules": args.schedules,
        "lead_ms": args.lead_ms,
        "target": args.target,
        "ticks_per_s_1": median(1, "ticks_per_s"),
        "ticks_per_s_3": median(3, "ticks_per_s"),
        "ticks_ratio_3_to_1": round(median(3, "ticks_per_s") / median(1, "ticks_per_s"), 3),
        "lag_p50_ms_1": median(1, "lag_p50_ms"),
        "lag_p99_ms_1": median(1, "lag_p99_ms"),
        "lag_p99_ms_1_spread": spread(1, "lag_p99_ms"),
        "lag_p50_ms": median(3, "lag_p50_ms"),
        "lag_p99_ms": median(3, "lag_p99_ms"),
        "lag_p99_ms_spread": spread(3, "lag_p99_ms"),
        "lag_commit_p99_ms_1": median(1, "lag_commit_p99_ms"),
        "lag_commit_p99_ms": median(3, "lag_commit_p99_ms"),
        "all_fired_ms_1": median(1, "all_fired_ms"),
        "all_fired_ms_3": median(3, "all_fired_ms"),
        "lag_p99_ms_1_lead0": median(1, "lag_p99_ms", 0),
        "lag_p99_ms_lead0": median(3, "lag_p99_ms", 0),
        "lag_p99_ms_lead0_spread": spread(3, "lag_p99_ms", 0),
        "lag_commit_p99_ms_1_lead0": median(1, "lag_commit_p99_ms", 0),
        "lag_commit_p99_ms_lead0": median(3, "lag_commit_p99_ms", 0),
        **(
            {
                "lag_publish_p99_ms_1": median(1, "lag_publish_p99_ms"),
                "lag_publish_p99_ms": median(3, "lag_publish_p99_ms"),
                "lag_publish_p99_ms_spread": spread(3, "lag_publish_p99_ms"),
                "lag_publish_p99_ms_1_lead0": median(1, "lag_publish_p99_ms", 0),
                "lag_publish_p99_ms_lead0": median(3, "lag_publish_p99_ms", 0),
            }
            if args.relay and args.target == "outbox"
            else {}
        ),
        **(
            {
                "lag_claim_p99_ms_1": median(1, "lag_claim_p99_ms"),
                "lag_claim_p99_ms": median(3, "lag_claim_p99_ms"),
                "lag_claim_p99_ms_spread": spread(3, "lag_claim_p99_ms"),
                "lag_claim_p99_ms_1_lead0": median(1, "lag_claim_p99_ms", 0),
                "lag_claim_p99_ms_lead0": median(3, "lag_claim_p99_ms", 0),
            }
            if args.consumers and args.target == "queue"
            else {}
        ),
        "load_1m": round(os.getloadavg()[0], 1),
        **single,
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
