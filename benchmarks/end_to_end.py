"""End-to-end benchmark: a job from the producer's commit to the effect row, ours against plain Dramatiq and the peers.

    pip install -e '.[bench]'
    python benchmarks/end_to_end.py [--jobs 1000] [--rounds 1] [--rate 200] [--latency-seconds 5]
                                    [--relay worker|process] [--producers 1|2] [--systems ours,plain,...]
                                    [--phases drain,e2d,latency] [--warmup 100] [--processes 1-4]
    python benchmarks/end_to_end.py --phases drain --systems ours,plain --rounds 7 --jobs 2000

Systems, each measured with the same one-INSERT actor and its worker in a process of its own
(1 process; 8 threads for the Dramatiq-based ones, 8 concurrent tasks for the asyncio ones;
the actor's INSERT runs on one of 8 connections in every system):

  ours               ``OutboxBroker``: each job is sent inside ``broker.transaction()`` with a
                     business row in the same transaction; the relay publishes it to RabbitMQ;
                     the worker runs the full middleware list (Tracing with no-op providers,
                     Idempotency, DeadLetters, WorkerRelay, ClassifiedRetries); the actor's
                     INSERT commits with the idempotency key on ``job_connection()``.
  plain              plain Dramatiq: ``RabbitmqBroker(confirm_delivery=True)``, Dramatiq's
                     default middleware, the send made after the business row's commit.
  pgqueuer, dramatiq_postgres, procrastinate
                     the Postgres job queues, the enqueue made after the business row's commit.
  postgres_broker    (an extra line, not in the ratios) our ``PostgresBroker`` with Tracing,
                     Idempotency, DeadLetters and ClassifiedRetries, sent like ``ours``.
  plain_key          (the ceiling, not in the peers) plain Dramatiq, sent like ``plain``, whose
                     actor runs what ``Idempotency`` runs for ``ours`` itself: ``BEGIN``, the
                     key's claim (a random key, as message ids are), the INSERT, ``COMMIT``.
                     ``drain_ceiling_ratio`` (plain_key / plain) is what the key's statements
                     cost; ``drain_ratio_to_ceiling`` (ours / plain_key) what the rest does:
                     the relay, the middleware, the outbox.

The relay of ``ours`` is ``WorkerRelay`` by default (``--relay worker``): it is the relay in the
middleware list, and it shares the worker's process and GIL, the harder case for us.  With
``--relay process`` a stand-alone ``Relay`` runs in a third process instead.

For every system, in one worker process, three phases:

  1. drain: ``--jobs`` jobs are loaded while the worker (and so ``WorkerRelay``) waits; then
     the worker starts.  The first ``--warmup`` jobs (100) open the worker's connections,
     prepare its statements and start the relay, untimed: drain jobs/s = (jobs - warmup) /
     (last effect row - the warmup-th effect row).  ``drain_cold_per_s`` keeps the figure
     with the start-up in it, jobs / (last effect row - start).  For ``ours`` the backlog sits
     in the outbox, so the relay's catch-up is part of the drain.  The CPU the worker
     processes (and a relay process) and their own Postgres backends (named by
     ``PGAPPNAME``) use between the warmup-th and the last row, per job, read from ``/proc``:
     ``drain_worker_cpu_us``, ``drain_postgres_cpu_us`` and their sum ``drain_cpu_us``.
  2. enqueue-then-drain: with the worker running, the producer sends ``--jobs`` jobs as fast as
     it can, one transaction each; jobs/s = jobs / (last effect row - first send).  One producer
     thread is bounded by its own round trips per job; ``--producers 2`` runs two, in threads
     with their own connections, job n sent by producer n mod 2 (in every phase).
  3. latency: ``--rate`` jobs/s for ``--latency-seconds``; per job, from the producer's commit
     of the business row (``time.time()`` after it returns) to the effect row's
     ``clock_timestamp()`` (same host, same clock), p50 and p99.

``--phases`` runs a subset of the three (``--phases drain`` for quick rounds of the drain
alone); ``--processes`` starts that many worker processes per system, for the scaling curve.

Rounds (``--rounds``) interleave the systems (each round starts one system later: ours,
plain, then plain, ours, ...) and the figures are medians over rounds; each ratio is the
median of the rounds' paired ratios (ours and its baseline ran a minute apart, under the
same load), with their [min, max] under the same key plus ``_spread``.  Each system gets its
own schema and queue, named ``perfe2e_<run>_<system>``, dropped or deleted at the end, also on failure or Ctrl-C; child
processes are stopped and, past a timeout, killed.  The last line printed is one JSON object:
``ratio_to_plain`` (enqueue-then-drain, ours / plain), ``ratio_to_best_peer`` (ours / the best
of pgqueuer, dramatiq_postgres and procrastinate), ``drain_ratio_to_plain``,
``drain_cold_ratio_to_plain``, ``drain_cpu_per_job_ratio_to_plain`` (CPU per job, ours / plain:
above 1 costs more), ``postgres_broker_drain_ratio_to_plain``, each with its ``_spread``,
``latency_p99_ms`` and ``latency_p50_ms`` (ours), every round's drain ratios under
``round_ratios`` and every system's median figures under ``systems``.

The cluster case (``--cluster``) measures ``ours`` alone, the same three phases, on RabbitMQ
nodes of its own started from the machine's install by ``tests/rabbitmq_nodes.py`` (run as root,
as the tests are): a 3-node cluster with quorum queues (the worker and its relay take every
node's URL) against one such node with Dramatiq's classic queue, today's setup, interleaved over
``--rounds``.  Its JSON line: ``end_to_end_cluster_ratio`` (enqueue-then-drain, cluster / one
node) and ``drain_cluster_ratio``, each the median of the rounds' paired ratios, and both setups'
median figures under ``setups``.  Starting the nodes
takes about 30 s; they are killed and removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import select
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import IO, Any

import dramatiq
import pika
import psycopg
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.common import dq_name, xq_name
from psycopg import sql

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
#: One URL, or several separated by ``;`` (a cluster's nodes); the cluster case sets it for its children.
RABBITMQ_URL = os.environ.get("RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
#: ``ours``'s queue type: ``classic`` (Dramatiq's declare) or ``quorum``; set by the cluster case.
QUEUE_TYPE = os.environ.get("E2E_QUEUE_TYPE", "classic")
PREFIX = "perfe2e_"
THREADS = 8
READY = "E2E-READY"
SYSTEMS = ("ours", "plain", "pgqueuer", "dramatiq_postgres", "procrastinate", "postgres_broker", "plain_key")
PEERS = ("pgqueuer", "dramatiq_postgres", "procrastinate")
ACTOR = "e2e_job"
PHASE_DRAIN, PHASE_E2D, PHASE_LATENCY = 1, 2, 3
PHASES = ("drain", "e2d", "latency")


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def effect_sql(schema: str) -> sql.Composed:
    return sql.SQL("INSERT INTO {} (phase, n) VALUES (%s, %s)").format(sql.Identifier(schema, "effects"))


def order_sql(schema: str) -> sql.Composed:
    return sql.SQL("INSERT INTO {} (phase, n) VALUES (%s, %s)").format(sql.Identifier(schema, "orders"))


def rabbitmq_parameters() -> list[pika.URLParameters]:
    return [pika.URLParameters(url) for url in RABBITMQ_URL.split(";")]


def search_path(schema: str) -> str:
    return f"-c search_path={schema}"


def with_query(url: str, **params: object) -> str:
    extra = "&".join(f"{key}={value}" for key, value in params.items())
    return f"{url}{'&' if '?' in url else '?'}{extra}"


# -- the brokers and actors, shared by the producer and the worker process -------------------------


class ThreadConnections:
    """The one-INSERT actor of the Dramatiq-based baselines: an autocommit connection per worker thread."""

    def __init__(self, schema: str) -> None:
        self.query = effect_sql(schema)
        self.local = threading.local()

    def __call__(self, phase: int, n: int) -> None:
        conn = getattr(self.local, "conn", None)
        if conn is None:
            conn = self.local.conn = psycopg.connect(DATABASE_URL, autocommit=True)
        conn.execute(self.query, (phase, n))


class ThreadKeyedConnections(ThreadConnections):
    """The ceiling of ``ours``'s worker side: plain Dramatiq whose actor runs the statements
    ``Idempotency`` runs (``BEGIN``, the key's claim, the INSERT, ``COMMIT``) itself."""

    def __init__(self, schema: str) -> None:
        from dramatiq_reliable import _sql

        super().__init__(schema)
        self.claim = _sql.rendered("idempotency_claim", schema)

    def __call__(self, phase: int, n: int) -> None:
        from dramatiq_reliable.idempotency import payload_hash

        conn = getattr(self.local, "conn", None)
        if conn is None:
            conn = self.local.conn = psycopg.connect(DATABASE_URL)
        key = str(uuid.uuid4())  # random, as the message ids the middleware uses are
        params = {
            "actor_name": ACTOR,
            "job_key": key,
            "payload_hash": payload_hash((phase, n), {}),
            "message_id": key,
            "retention_s": 604_800.0,
        }
        with conn.transaction():
            conn.execute(self.claim, params).fetchone()
            conn.execute(self.query, (phase, n))


def _job_connection_actor(schema: str) -> Callable[[int, int], None]:
    from dramatiq_reliable import job_connection

    query = effect_sql(schema)

    def run(phase: int, n: int) -> None:
        # The effect commits with the idempotency key, in the job's transaction.
        job_connection().execute(query, (phase, n))

    return run


def _full_middleware(*, relay: bool) -> list[Any]:
    from opentelemetry import metrics, trace

    from dramatiq_reliable import ClassifiedRetries, DeadLetters, Idempotency, Tracing, WorkerRelay, build_middleware

    front: list[Any] = [
        Tracing(tracer_provider=trace.NoOpTracerProvider(), meter_provider=metrics.NoOpMeterProvider()),
        Idempotency(),
        DeadLetters(),
    ]
    if relay:
        front.append(WorkerRelay())
    return build_middleware(retries=ClassifiedRetries(), middleware=front)


def dramatiq_broker(system: str, schema: str, *, role: str, relay: str) -> tuple[dramatiq.Broker, Any]:
    """The broker and actor of a Dramatiq-based system; ``role`` is ``producer`` or ``worker``."""
    worker = role == "worker"
    if system == "ours":
        from dramatiq_reliable import OutboxBroker

        broker: dramatiq.Broker = OutboxBroker(
            url=RABBITMQ_URL,
            database=DATABASE_URL,
            schema=schema,
            pool_max_size=THREADS + 4 if worker else 1,
            middleware=_full_middleware(relay=relay == "worker"),
            **({"queue_type": QUEUE_TYPE} if QUEUE_TYPE != "classic" else {}),
        )
        fn: Callable[[int, int], None] = _job_connection_actor(schema)
    elif system == "postgres_broker":
        from dramatiq_reliable import PostgresBroker

        broker = PostgresBroker(
            database=DATABASE_URL,
            schema=schema,
            pool_max_size=THREADS + 4 if worker else 1,
            middleware=_full_middleware(relay=False),
        )
        fn = _job_connection_actor(schema)
    elif system == "plain":
        broker = RabbitmqBroker(url=RABBITMQ_URL, confirm_delivery=True)
        fn = ThreadConnections(schema)
    elif system == "plain_key":
        broker = RabbitmqBroker(url=RABBITMQ_URL, confirm_delivery=True)
        fn = ThreadKeyedConnections(schema)
    elif system == "dramatiq_postgres":
        import dramatiq_postgres

        # Its pool (8 in the worker) comes on top of the actor's 8: 20 connections in all.
        url = with_query(DATABASE_URL, maxconn=THREADS if worker else 1)
        broker = dramatiq_postgres.PostgresBroker(url=url, schema=schema, results=False)
        fn = ThreadConnections(schema)
    else:
        raise ValueError(f"{system!r} is not a Dramatiq-based system")
    actor = dramatiq.actor(fn, actor_name=ACTOR, queue_name=schema, broker=broker)
    return broker, actor


# -- producers: one send per job, returning the time the business row committed ------------------


class Producer:
    def open(self) -> None: ...

    def send(self, phase: int, n: int) -> float:
        raise NotImplementedError

    def close(self) -> None: ...


class OutboxProducer(Producer):
    """``ours`` and ``postgres_broker``: the business row and the message in one transaction."""

    def __init__(self, system: str, schema: str, relay: str) -> None:
        self.broker, self.actor = dramatiq_broker(system, schema, role="producer", relay=relay)
        self.order = order_sql(schema)

    def send(self, phase: int, n: int) -> float:
        with self.broker.transaction() as conn:  # type: ignore[attr-defined]
            conn.execute(self.order, (phase, n))
            self.actor.send(phase, n)
        return time.time()

    def close(self) -> None:
        self.broker.close()


class AfterCommitProducer(Producer):
    """The baselines: the business row commits, then the job is sent with the system's own API."""

    def __init__(self, schema: str) -> None:
        self.schema = schema
        self.order = order_sql(schema)
        self.conn: psycopg.Connection[Any] | None = None

    def open(self) -> None:
        self.conn = psycopg.connect(DATABASE_URL, autocommit=True)

    def send(self, phase: int, n: int) -> float:
        assert self.conn is not None
        with self.conn.transaction():
            self.conn.execute(self.order, (phase, n))
        committed = time.time()
        self.enqueue(phase, n)
        return committed

    def enqueue(self, phase: int, n: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


class DramatiqProducer(AfterCommitProducer):
    def __init__(self, system: str, schema: str) -> None:
        super().__init__(schema)
        self.broker, self.actor = dramatiq_broker(system, schema, role="producer", relay="worker")

    def enqueue(self, phase: int, n: int) -> None:
        self.actor.send(phase, n)

    def close(self) -> None:
        super().close()
        self.broker.close()


class AsyncProducer(AfterCommitProducer):
    """An asyncio peer driven from its producer thread: one event loop, kept for the producer's life.

    ``install``: create the peer's tables (the first producer of a run does).
    """

    def __init__(self, schema: str, *, install: bool) -> None:
        super().__init__(schema)
        self.install = install
        self.loop = asyncio.new_event_loop()

    def enqueue(self, phase: int, n: int) -> None:
        self.loop.run_until_complete(self.aenqueue(phase, n))

    async def aenqueue(self, phase: int, n: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        try:
            self.loop.run_until_complete(self.aclose())
        finally:
            self.loop.close()
            super().close()

    async def aclose(self) -> None: ...


class PgQueuerProducer(AsyncProducer):
    def open(self) -> None:
        super().open()
        self.loop.run_until_complete(self.aopen())

    async def aopen(self) -> None:
        from pgqueuer import PsycopgDriver, Queries

        self.aconn = await psycopg.AsyncConnection.connect(
            DATABASE_URL, autocommit=True, options=search_path(self.schema)
        )
        self.queries = Queries(PsycopgDriver(self.aconn))
        if self.install:
            await self.queries.install(create_schema=False)

    async def aenqueue(self, phase: int, n: int) -> None:
        await self.queries.enqueue(ACTOR, f"{phase},{n}".encode())

    async def aclose(self) -> None:
        if hasattr(self, "aconn"):
            await self.aconn.close()


def procrastinate_app(schema: str, *, max_size: int) -> Any:
    import procrastinate

    return procrastinate.App(
        connector=procrastinate.PsycopgConnector(
            conninfo=DATABASE_URL, kwargs={"options": search_path(schema)}, min_size=1, max_size=max_size
        )
    )


class ProcrastinateProducer(AsyncProducer):
    def open(self) -> None:
        super().open()
        self.app = procrastinate_app(self.schema, max_size=1)

        @self.app.task(name=ACTOR, queue=self.schema)
        async def job(phase: int, n: int) -> None:  # never run here: the worker process runs it
            raise AssertionError("the producer does not run jobs")

        self.task = job
        self.loop.run_until_complete(self.aopen())

    async def aopen(self) -> None:
        await self.app.open_async()
        if self.install:
            await self.app.schema_manager.apply_schema_async()

    async def aenqueue(self, phase: int, n: int) -> None:
        await self.task.defer_async(phase=phase, n=n)

    async def aclose(self) -> None:
        if hasattr(self, "app"):
            await self.app.close_async()


def make_producer(system: str, schema: str, relay: str, *, install: bool) -> Producer:
    if system in ("ours", "postgres_broker"):
        return OutboxProducer(system, schema, relay)
    if system in ("plain", "plain_key", "dramatiq_postgres"):
        return DramatiqProducer(system, schema)
    if system == "pgqueuer":
        return PgQueuerProducer(schema, install=install)
    if system == "procrastinate":
        return ProcrastinateProducer(schema, install=install)
    raise ValueError(f"unknown system {system!r}")


def prepare(system: str, schema: str) -> None:
    """Create the schema, the business and effect tables, and the system's own tables."""
    with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        for table in ("orders", "effects"):
            conn.execute(
                sql.SQL(
                    "CREATE TABLE {} (phase smallint NOT NULL, n int NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())"
                ).format(sql.Identifier(schema, table))
            )
        if system == "dramatiq_postgres":
            import dramatiq_postgres

            with conn.cursor() as cursor:
                dramatiq_postgres.init(cursor, schema=schema)
    if system in ("ours", "postgres_broker", "plain_key"):
        from dramatiq_reliable import migrate

        migrate(DATABASE_URL, schema=schema)
    if system == "ours" and QUEUE_TYPE != "classic":
        # Quorum queues are declared with OutboxBroker's own arguments, as its worker does.
        from dramatiq_reliable import OutboxBroker

        outbox_declarer = OutboxBroker(
            url=RABBITMQ_URL, database=DATABASE_URL, schema=schema, pool_max_size=1, queue_type=QUEUE_TYPE
        )
        try:
            outbox_declarer.declare_queue(schema, ensure=True)
        finally:
            outbox_declarer.close()
    elif system in ("plain", "plain_key", "ours"):
        declarer = RabbitmqBroker(url=RABBITMQ_URL, middleware=[])
        try:
            declarer.declare_queue(schema, ensure=True)
        finally:
            declarer.close()
    # pgqueuer and procrastinate install their tables from the producer (their own APIs).


def cleanup(system: str, schema: str) -> None:
    """Drop the schema (the peers' tables are in it) and delete the RabbitMQ queues; never raises."""
    try:
        with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
            conn.execute("SET lock_timeout = '30s'")
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
    except psycopg.Error as error:
        log(f"could not drop schema {schema!r}: {error}; drop it by hand: DROP SCHEMA {schema} CASCADE")
    if system in ("plain", "plain_key", "ours"):
        try:
            connection = pika.BlockingConnection(rabbitmq_parameters())
            try:
                channel = connection.channel()
                for queue in (schema, dq_name(schema), xq_name(schema)):
                    channel.queue_delete(queue)
            finally:
                connection.close()
        except pika.exceptions.AMQPError as error:
            log(f"could not delete the queues of {schema!r}: {error!r}; delete them with rabbitmqctl")


# -- the worker process -------------------------------------------------------------------------------


def _child_streams() -> IO[str]:
    """Send everything the child prints to stderr; return a stream on the real stdout for READY."""
    import signal

    # Ctrl-C reaches the whole process group: the parent alone handles it, stopping its
    # children in order (and killing them past a timeout), then dropping what it created.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ready = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    return ready


def _wait_line() -> str:
    return sys.stdin.readline().strip()


def child_main(role: str, system: str, schema: str, relay: str) -> None:
    """Run a worker (or the stand-alone relay) for ``system``: READY, wait for ``go``, run until ``stop`` or EOF."""
    ready = _child_streams()
    if role == "relay":
        from dramatiq_reliable import OutboxBroker, Relay

        relay_broker = OutboxBroker(
            url=RABBITMQ_URL,
            database=DATABASE_URL,
            schema=schema,
            pool_max_size=2,
            **({"queue_type": QUEUE_TYPE} if QUEUE_TYPE != "classic" else {}),
        )
        relay_loop = Relay.from_broker(relay_broker)
        print(READY, file=ready, flush=True)
        _wait_line()
        thread = threading.Thread(target=relay_loop.run, daemon=True)
        thread.start()
        _wait_line()
        relay_loop.stop()
        thread.join(10)
        relay_broker.close()
        os._exit(0)
    if system in ("pgqueuer", "procrastinate"):
        asyncio.run(_async_worker(system, schema, ready))
        os._exit(0)
    broker, _actor = dramatiq_broker(system, schema, role="worker", relay=relay)
    broker.emit_after("process_boot")  # as Dramatiq's CLI does in a worker process
    worker = dramatiq.Worker(broker, worker_threads=THREADS, worker_timeout=100)
    print(READY, file=ready, flush=True)
    _wait_line()
    worker.start()
    _wait_line()
    worker.stop(timeout=10_000)
    broker.close()
    os._exit(0)


async def _async_worker(system: str, schema: str, ready: IO[str]) -> None:
    from psycopg_pool import AsyncConnectionPool

    query = effect_sql(schema)
    effects: AsyncConnectionPool[Any] = AsyncConnectionPool(
        DATABASE_URL, min_size=THREADS, max_size=THREADS, kwargs={"autocommit": True}, open=False
    )
    await effects.open(wait=True)
    loop = asyncio.get_running_loop()

    def exit_on_stop() -> None:
        _wait_line()
        os._exit(0)  # the peers' own shutdown is not measured; the schema is dropped after this

    if system == "pgqueuer":
        from pgqueuer import PgQueuer, PsycopgDriver

        conn = await psycopg.AsyncConnection.connect(DATABASE_URL, autocommit=True, options=search_path(schema))
        pgq = PgQueuer(PsycopgDriver(conn))

        @pgq.entrypoint(ACTOR)
        async def job(job: Any) -> None:
            phase, n = bytes(job.payload).decode().split(",")
            async with effects.connection() as c:
                await c.execute(query, (int(phase), int(n)))

        print(READY, file=ready, flush=True)
        await loop.run_in_executor(None, _wait_line)
        threading.Thread(target=exit_on_stop, daemon=True).start()
        # batch_size=100 is PgQueuer's best setting in benchmarks/postgres_broker.py; the
        # INSERTs are bounded by the 8 connections of ``effects``, as in every system here.
        await pgq.run(batch_size=100, dequeue_timeout=timedelta(seconds=5))
    else:
        app = procrastinate_app(schema, max_size=THREADS)

        @app.task(name=ACTOR, queue=schema)
        async def job(phase: int, n: int) -> None:
            async with effects.connection() as c:
                await c.execute(query, (phase, n))

        async with app.open_async():
            print(READY, file=ready, flush=True)
            await loop.run_in_executor(None, _wait_line)
            threading.Thread(target=exit_on_stop, daemon=True).start()
            await app.run_worker_async(
                queues=[schema], concurrency=THREADS, wait=True, install_signal_handlers=False, delete_jobs="never"
            )


class Child:
    """A child process of this script (a worker or a relay), stopped and if need be killed on exit."""

    def __init__(self, role: str, system: str, schema: str, relay: str) -> None:
        self.name = f"{role} of {system}"
        # Kept open for the child's life (stop() closes it): read back when the child fails.
        self.stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
        self.process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--child", role, system, schema, relay],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            # libpq names every connection the child opens: the parent finds its backends' CPU.
            env={**os.environ, "PGAPPNAME": schema},
        )

    def wait_ready(self, timeout_s: float = 60) -> None:
        assert self.process.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            readable, _, _ = select.select([self.process.stdout], [], [], 0.2)
            if readable:
                line = self.process.stdout.readline()
                if line.strip() == READY:
                    return
                if not line:
                    break
            self.check()
        self.fail(f"the {self.name} did not get ready in {timeout_s:.0f} s")

    def say(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def check(self) -> None:
        if self.process.poll() is not None:
            self.fail(f"the {self.name} exited with code {self.process.returncode}")

    def fail(self, reason: str) -> None:
        self.stderr.seek(0)
        tail = self.stderr.read()[-3000:]
        raise SystemExit(f"{reason}; its stderr ends with:\n{tail}")

    def stop(self) -> None:
        try:
            if self.process.poll() is None:
                assert self.process.stdin is not None
                try:
                    self.process.stdin.write("stop\n")
                    self.process.stdin.close()
                except OSError:
                    pass
                try:
                    self.process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    log(f"the {self.name} did not stop in 20 s; killing it")
                    self.process.kill()
                    self.process.wait(timeout=10)
        finally:
            if self.process.stdout is not None:
                self.process.stdout.close()
            self.stderr.close()


# -- one system, three phases -------------------------------------------------------------------------


class Effects:
    """Reads the effect rows of one schema on one connection."""

    def __init__(self, schema: str) -> None:
        self.conn = psycopg.connect(DATABASE_URL, autocommit=True)
        table = sql.Identifier(schema, "effects")
        self.progress = sql.SQL("SELECT count(*), extract(epoch FROM max(at)) FROM {} WHERE phase = %s").format(table)
        self.rows = sql.SQL("SELECT n, extract(epoch FROM at) FROM {} WHERE phase = %s").format(table)
        self.nth = sql.SQL(
            "SELECT extract(epoch FROM at) FROM {} WHERE phase = %s ORDER BY at OFFSET %s LIMIT 1"
        ).format(table)

    def wait(self, phase: int, expected: int, children: list[Child], timeout_s: float) -> float:
        """Poll until ``expected`` effect rows of ``phase`` exist; return the last one's time."""
        deadline = time.monotonic() + timeout_s
        while True:
            row = self.conn.execute(self.progress, (phase,)).fetchone()
            assert row is not None
            count, last = int(row[0]), row[1]
            if count >= expected:
                return float(last)
            for child in children:
                child.check()
            if time.monotonic() > deadline:
                raise SystemExit(f"only {count} of {expected} jobs ran in {timeout_s:.0f} s (phase {phase})")
            time.sleep(0.01)

    def count(self, phase: int) -> int:
        row = self.conn.execute(self.progress, (phase,)).fetchone()
        return int(row[0]) if row else 0

    def cpu_s(self, children: list[Child], schema: str) -> tuple[float, float] | None:
        """CPU seconds used so far by the children and by their Postgres backends (Linux ``/proc``)."""
        rows = self.conn.execute("SELECT pid FROM pg_stat_activity WHERE application_name = %s", (schema,))
        workers = [cpu_seconds(child.process.pid) for child in children]
        backends = [cpu_seconds(int(pid)) for (pid,) in rows.fetchall()]
        if None in workers or None in backends or not backends:
            return None
        return sum(w for w in workers if w is not None), sum(b for b in backends if b is not None)

    def nth_time(self, phase: int, k: int) -> float:
        """The time of the ``k``-th effect row of ``phase`` (1-based, in commit order)."""
        row = self.conn.execute(self.nth, (phase, k - 1)).fetchone()
        assert row is not None, f"fewer than {k} effect rows in phase {phase}"
        return float(row[0])

    def times(self, phase: int) -> dict[int, float]:
        return {int(n): float(at) for n, at in self.conn.execute(self.rows, (phase,)).fetchall()}

    def close(self) -> None:
        self.conn.close()


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process so far (Linux ``/proc``), ``None`` if unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def in_threads(producers: list[Producer], work: Callable[[int, Producer], None]) -> None:
    """Run ``work(i, producer)`` for each producer in a thread of its own; re-raise the first failure."""
    errors: list[BaseException] = []

    def run(i: int, producer: Producer) -> None:
        try:
            work(i, producer)
        except BaseException as error:  # reported in the main thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i, p), daemon=True) for i, p in enumerate(producers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def run_system(system: str, run_id: str, args: argparse.Namespace) -> dict[str, float]:
    schema = f"{PREFIX}{run_id}_{system}"
    jobs = args.jobs
    timeout_s = max(120.0, jobs / 20)
    children: list[Child] = []
    producers: list[Producer] = []
    effects: Effects | None = None
    try:
        prepare(system, schema)
        for i in range(args.producers):
            producers.append(make_producer(system, schema, args.relay, install=i == 0))
            producers[-1].open()
        effects = Effects(schema)
        for _ in range(args.processes):
            children.append(Child("worker", system, schema, args.relay))
        if system == "ours" and args.relay == "process":
            children.append(Child("relay", system, schema, args.relay))
        for child in children:
            child.wait_ready()
        count = len(producers)

        def burst(phase: int) -> Callable[[int, Producer], None]:
            def work(i: int, producer: Producer) -> None:
                for n in range(i, jobs, count):  # producer i sends every count-th job
                    producer.send(phase, n)

            return work

        figures: dict[str, float] = {}
        if "drain" in args.phases:
            # 1. drain a backlog loaded while the worker waits; the first ``--warmup`` jobs open the
            # workers' connections, prepare their statements and start the relay, untimed
            in_threads(producers, burst(PHASE_DRAIN))
            started = time.time()
            for child in children:
                child.say("go")
            if args.warmup:
                effects.wait(PHASE_DRAIN, args.warmup, children, timeout_s)
            cpu_before, done_before = effects.cpu_s(children, schema), effects.count(PHASE_DRAIN)
            last = effects.wait(PHASE_DRAIN, jobs, children, timeout_s)
            cpu_after = effects.cpu_s(children, schema)
            if cpu_before is not None and cpu_after is not None and jobs > done_before:
                # steadier than the rates on a shared machine: what a job costs, not how long it waited
                per_job = 1e6 / (jobs - done_before)
                figures["drain_worker_cpu_us"] = round((cpu_after[0] - cpu_before[0]) * per_job)
                figures["drain_postgres_cpu_us"] = round((cpu_after[1] - cpu_before[1]) * per_job)
                figures["drain_cpu_us"] = figures["drain_worker_cpu_us"] + figures["drain_postgres_cpu_us"]
            first = effects.nth_time(PHASE_DRAIN, args.warmup) if args.warmup else started
            figures["drain_per_s"] = round((jobs - args.warmup) / (last - first), 1)
            # the figure before the warm-up was measured: start-up, first connections and all
            figures["drain_cold_per_s"] = round(jobs / (last - started), 1)
        else:
            for child in children:
                child.say("go")

        if "e2d" in args.phases:
            # 2. enqueue then drain, the worker running
            started = time.time()
            in_threads(producers, burst(PHASE_E2D))
            sent = time.time()
            last = effects.wait(PHASE_E2D, jobs, children, timeout_s)
            figures["enqueue_then_drain_per_s"] = round(jobs / (last - started), 1)
            figures["enqueue_per_s"] = round(jobs / (sent - started), 1)

        if "latency" in args.phases:
            # 3. commit-to-effect latency at a steady rate, job n due at begin + n / rate
            total = max(1, int(args.rate * args.latency_seconds))
            committed: dict[int, float] = {}
            begin = time.monotonic()

            def steady(i: int, producer: Producer) -> None:
                for n in range(i, total, count):
                    pause = begin + n / args.rate - time.monotonic()
                    if pause > 0:
                        time.sleep(pause)
                    committed[n] = producer.send(PHASE_LATENCY, n)

            in_threads(producers, steady)
            achieved = total / (time.monotonic() - begin)
            effects.wait(PHASE_LATENCY, total, children, timeout_s)
            at = effects.times(PHASE_LATENCY)
            latencies = sorted((at[n] - committed[n]) * 1000 for n in committed)
            figures["latency_p50_ms"] = round(statistics.median(latencies), 2)
            figures["latency_p99_ms"] = round(latencies[max(0, int(len(latencies) * 0.99) - 1)], 2)
            figures["latency_rate_per_s"] = round(achieved, 1)
        return figures
    finally:
        for child in children:
            child.stop()
        for producer in producers:
            try:
                producer.close()
            except Exception as error:  # the cleanup below must still run
                log(f"closing the {system} producer failed: {error!r}")
        if effects is not None:
            effects.close()
        cleanup(system, schema)


def installed(system: str) -> bool:
    module = {"pgqueuer": "pgqueuer", "dramatiq_postgres": "dramatiq_postgres", "procrastinate": "procrastinate"}
    if system not in module:
        return True
    try:
        __import__(module[system])
    except ImportError as error:
        log(f"{system}: skipped, not installed ({error}); pip install -e '.[bench]'")
        return False
    return True


def medians(rounds: list[dict[str, float]]) -> dict[str, float]:
    return {key: round(statistics.median(r[key] for r in rounds), 2) for key in rounds[0]}


def ratio(ours: float | None, baseline: float | None) -> float | None:
    return round(ours / baseline, 2) if ours and baseline else None


def paired_ratios(per_round: dict[str, list[dict[str, float]]], system: str, baseline: str, key: str) -> list[float]:
    """``system`` / ``baseline`` round by round: the two ran minutes apart, so the machine's load
    drifts less between them than between rounds, and each round's ratio is a fair sample."""
    pairs = zip(per_round.get(system, []), per_round.get(baseline, []), strict=False)
    return [ours[key] / base[key] for ours, base in pairs if ours.get(key) and base.get(key)]


def headline(
    figures: dict[str, dict[str, float]],
    per_round: dict[str, list[dict[str, float]]] | None,
    system: str | None,
    baseline: str | None,
    key: str,
) -> tuple[float | None, list[float] | None]:
    """The median of the paired per-round ratios and their [min, max]; from the medians' ratio
    (no spread) when there are no rounds to pair."""
    if system is None or baseline is None:
        return None, None
    paired = paired_ratios(per_round, system, baseline, key) if per_round else []
    if paired:
        return round(statistics.median(paired), 2), [round(min(paired), 2), round(max(paired), 2)]
    return ratio(figures.get(system, {}).get(key), figures.get(baseline, {}).get(key)), None


def summary(
    figures: dict[str, dict[str, float]],
    args: argparse.Namespace,
    load: list[float],
    per_round: dict[str, list[dict[str, float]]] | None = None,
) -> dict[str, Any]:
    peers = [name for name in PEERS if "enqueue_then_drain_per_s" in figures.get(name, {})]
    best_peer = max(peers, key=lambda name: figures[name]["enqueue_then_drain_per_s"]) if peers else None

    def figure(system: str | None, key: str) -> float | None:
        return figures.get(system, {}).get(key) if system is not None else None

    e2d, e2d_spread = headline(figures, per_round, "ours", "plain", "enqueue_then_drain_per_s")
    peer, peer_spread = headline(figures, per_round, "ours", best_peer, "enqueue_then_drain_per_s")
    drain, drain_spread = headline(figures, per_round, "ours", "plain", "drain_per_s")
    cold, cold_spread = headline(figures, per_round, "ours", "plain", "drain_cold_per_s")
    cpu, cpu_spread = headline(figures, per_round, "ours", "plain", "drain_cpu_us")
    pg_drain, pg_drain_spread = headline(figures, per_round, "postgres_broker", "plain", "drain_per_s")
    ceiling, ceiling_spread = headline(figures, per_round, "plain_key", "plain", "drain_per_s")
    to_ceiling, to_ceiling_spread = headline(figures, per_round, "ours", "plain_key", "drain_per_s")
    return {
        "ratio_to_plain": e2d,
        "ratio_to_plain_spread": e2d_spread,
        "ratio_to_best_peer": peer,
        "ratio_to_best_peer_spread": peer_spread,
        "drain_ratio_to_plain": drain,
        "drain_ratio_to_plain_spread": drain_spread,
        "drain_cold_ratio_to_plain": cold,
        "drain_cold_ratio_to_plain_spread": cold_spread,
        "drain_cpu_per_job_ratio_to_plain": cpu,
        "drain_cpu_per_job_ratio_to_plain_spread": cpu_spread,
        "drain_ceiling_ratio": ceiling,
        "drain_ceiling_ratio_spread": ceiling_spread,
        "drain_ratio_to_ceiling": to_ceiling,
        "drain_ratio_to_ceiling_spread": to_ceiling_spread,
        "postgres_broker_drain_ratio_to_plain": pg_drain,
        "postgres_broker_drain_ratio_to_plain_spread": pg_drain_spread,
        "latency_p99_ms": figure("ours", "latency_p99_ms"),
        "latency_p50_ms": figure("ours", "latency_p50_ms"),
        "best_peer": best_peer,
        "jobs": args.jobs,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "phases": args.phases,
        "processes": args.processes,
        "rate_per_s": args.rate,
        "latency_seconds": args.latency_seconds,
        "relay": args.relay,
        "producers": args.producers,
        "threads": THREADS,
        "load_average_1m": load,
        "systems": figures,
        "round_ratios": {
            "drain_ratio_to_plain": [
                round(r, 2) for r in paired_ratios(per_round or {}, "ours", "plain", "drain_per_s")
            ]
        },
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1000, help="jobs per system in the drain and enqueue phases")
    parser.add_argument(
        "--rounds", type=int, default=1, help="rounds, systems interleaved; ratios are the median of the rounds' pairs"
    )
    parser.add_argument(
        "--phases",
        default=",".join(PHASES),
        help=f"comma-separated subset of {','.join(PHASES)} (--phases drain: the drain ratio alone, quick rounds)",
    )
    parser.add_argument(
        "--warmup", type=int, default=100, help="drain jobs run before the timing starts (connections, statements)"
    )
    parser.add_argument(
        "--processes",
        type=int,
        choices=range(1, 5),
        default=1,
        metavar="1-4",
        help="worker processes per system (the scaling curve); each holds up to 12 connections",
    )
    parser.add_argument(
        "--producers",
        type=int,
        choices=range(1, 3),
        default=1,
        metavar="1-2",
        help="producer threads in this process; each holds 2-3 connections (2: up to 21 in all)",
    )
    parser.add_argument("--rate", type=float, default=200.0, help="jobs/s in the latency phase")
    parser.add_argument("--latency-seconds", type=float, default=5.0, help="length of the latency phase")
    parser.add_argument(
        "--relay", choices=("worker", "process"), default="worker", help="WorkerRelay in the worker, or a Relay process"
    )
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    parser.add_argument(
        "--cluster",
        action="store_true",
        help="only ours: a 3-node cluster with quorum queues vs one node (nodes of its own; needs root)",
    )
    args = parser.parse_args(argv)
    chosen = [name.strip() for name in args.systems.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in SYSTEMS]
    if unknown:
        parser.error(f"unknown systems {unknown!r}; choose from {','.join(SYSTEMS)}")
    if args.jobs < 1 or args.rounds < 1 or args.rate <= 0 or args.latency_seconds <= 0:
        parser.error("--jobs and --rounds must be at least 1, --rate and --latency-seconds positive")
    phases = [name.strip() for name in args.phases.split(",") if name.strip()]
    if not phases or set(phases) - set(PHASES):
        parser.error(f"--phases must name some of {','.join(PHASES)}, got {args.phases!r}")
    if not 0 <= args.warmup < args.jobs:
        parser.error(f"--warmup must be at least 0 and below --jobs ({args.jobs}), got {args.warmup!r}")
    args.systems = chosen
    args.phases = [name for name in PHASES if name in phases]
    return args


@contextmanager
def _interrupts_as_exit() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so every ``finally`` (children, schemas, queues) runs."""
    import signal

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        child_main(*argv[1:5])
        return
    args = parse_args(argv)
    if args.cluster:
        cluster_main(args)
        return
    systems = [name for name in args.systems if installed(name)]
    run_id = uuid.uuid4().hex[:6]
    load = [round(os.getloadavg()[0], 2)]
    results: dict[str, list[dict[str, float]]] = {name: [] for name in systems}
    try:
        with _interrupts_as_exit():
            for round_no in range(args.rounds):
                shift = round_no % len(systems)
                for system in systems[shift:] + systems[:shift]:
                    figures = run_system(system, f"{run_id}{round_no}", args)
                    log(f"round {round_no + 1} {system}: {figures}")
                    results[system].append(figures)
    except KeyboardInterrupt:
        # run_system's finally blocks have stopped the children and dropped the schema and queues.
        raise SystemExit("interrupted; the worker processes, schemas and queues of this run are gone") from None
    load.append(round(os.getloadavg()[0], 2))
    figures = {name: medians(r) for name, r in results.items() if r}
    print(json.dumps(summary(figures, args, load, results)), flush=True)


# -- the cluster case ---------------------------------------------------------------------------------


def _use_rabbitmq(urls: list[str], queue_type: str) -> None:
    """Point this process and the children it starts from now on at ``urls`` with ``queue_type``."""
    global RABBITMQ_URL, QUEUE_TYPE
    RABBITMQ_URL = os.environ["RABBITMQ_URL"] = ";".join(urls)
    QUEUE_TYPE = os.environ["E2E_QUEUE_TYPE"] = queue_type


def cluster_main(args: argparse.Namespace) -> None:
    """``ours`` on one node (classic queue) and on a 3-node cluster (quorum queues), interleaved."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    import rabbitmq_nodes

    if (reason := rabbitmq_nodes.available()) is not None:
        raise SystemExit(f"the cluster case starts RabbitMQ nodes of its own and cannot here: {reason}")
    run_id = uuid.uuid4().hex[:6]
    load = [round(os.getloadavg()[0], 2)]
    setups: dict[str, list[dict[str, float]]] = {"one_node": [], "cluster": []}
    started = time.monotonic()
    try:
        with (
            _interrupts_as_exit(),
            rabbitmq_nodes.single_node() as node,
            rabbitmq_nodes.cluster(3) as cluster,
        ):
            log(f"nodes up in {time.monotonic() - started:.0f} s: one node {node.name}, cluster {cluster.urls}")
            plan = {"one_node": ([node.url], "classic"), "cluster": (cluster.urls, "quorum")}
            for round_no in range(args.rounds):
                order = ["one_node", "cluster"] if round_no % 2 == 0 else ["cluster", "one_node"]
                for setup in order:
                    _use_rabbitmq(*plan[setup])
                    figures = run_system("ours", f"{run_id}{round_no}{setup[0]}", args)
                    log(f"round {round_no + 1} {setup}: {figures}")
                    setups[setup].append(figures)
    except KeyboardInterrupt:
        raise SystemExit("interrupted; the worker processes, schemas, queues and nodes of this run are gone") from None
    load.append(round(os.getloadavg()[0], 2))
    figures = {name: medians(rounds) for name, rounds in setups.items()}

    def paired(key: str) -> float:
        # Each round's two setups ran a minute apart: their ratio drifts less with the machine's load.
        pairs = zip(setups["cluster"], setups["one_node"], strict=True)
        return round(statistics.median(c[key] / o[key] for c, o in pairs), 2)

    print(
        json.dumps(
            {
                "end_to_end_cluster_ratio": paired("enqueue_then_drain_per_s"),
                "drain_cluster_ratio": paired("drain_per_s"),
                "one_node": "a node started by tests/rabbitmq_nodes.py, classic queue (Dramatiq's default)",
                "cluster": "3 nodes started by tests/rabbitmq_nodes.py, quorum queues, every node's URL",
                "jobs": args.jobs,
                "rounds": args.rounds,
                "relay": args.relay,
                "producers": args.producers,
                "threads": THREADS,
                "load_average_1m": load,
                "setups": figures,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
