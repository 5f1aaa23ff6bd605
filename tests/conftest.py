"""Fixtures: a fresh Postgres schema and fresh RabbitMQ queue names for every test.

Services come from ``DATABASE_URL`` and ``RABBITMQ_URL`` (default: the local servers).  A
missing service skips the tests that need it on a laptop, and fails the run when ``CI=true``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import dramatiq
import embedded_postgres  # (first: an embedded Postgres if DATABASE_URL is unset)
import pika
import psycopg
import pytest
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from support import Otel, QueueJanitor, Rabbit, new_queue_name, status_server

from dramatiq_reliable import OutboxBroker, events, schema
from dramatiq_reliable._util import redact

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
RABBITMQ_URL = os.environ.get("RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


# Services found unreachable this session: name -> (environment variable, URL tried).
_MISSING: dict[str, tuple[str, str]] = {}
_SKIP_PREFIX = "service unreachable: "


def _unavailable(service: str, variable: str, url: str, error: BaseException) -> None:
    _MISSING[service] = (variable, url)
    message = redact(f"{service} is not reachable at {url} ({type(error).__name__}: {error})".replace("\n", " "))
    if IN_CI:
        pytest.fail(f"{message}; CI=true, so this is a failure, not a skip", pytrace=False)
    pytest.skip(_SKIP_PREFIX + message)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test by its folder, so ``-m unit`` runs the tests that need no service."""
    for item in items:
        parts = item.path.parts
        for kind in ("unit", "integration", "acceptance", "browser"):
            if kind in parts:
                item.add_marker(getattr(pytest.mark, kind))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """One line naming the services that were missing and how to point the tests at them."""
    if embedded_postgres.embedded_url is not None:
        terminalreporter.write_line(
            f"DATABASE_URL is not set: the tests ran on an embedded Postgres at {embedded_postgres.embedded_url}"
        )
    if not _MISSING:
        return
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if _SKIP_PREFIX in str(r.longrepr)]
    names = " and ".join(_MISSING)
    how = " ".join(f"{variable}={redact(url)!r}" for variable, url in _MISSING.values())
    terminalreporter.write_line(
        f"{len(skipped)} tests skipped: {names} not reachable (tried {how}); start them or point the "
        "tests at them with DATABASE_URL=postgresql://... RABBITMQ_URL=amqp://... (CI=true fails instead)",
        yellow=True,
        bold=True,
    )


@pytest.fixture(scope="session")
def database_url() -> str:
    try:
        with psycopg.connect(DATABASE_URL, connect_timeout=5) as conn:
            conn.execute("SELECT 1")
    except psycopg.OperationalError as error:
        _unavailable("Postgres", "DATABASE_URL", DATABASE_URL, error)
    return DATABASE_URL


@pytest.fixture(scope="session")
def rabbitmq_url() -> str:
    try:
        pika.BlockingConnection(pika.URLParameters(RABBITMQ_URL)).close()
    except pika.exceptions.AMQPError as error:
        _unavailable("RabbitMQ", "RABBITMQ_URL", RABBITMQ_URL, error)
    return RABBITMQ_URL


@pytest.fixture
def unmigrated_schema(database_url: str) -> Iterator[str]:
    """A schema name no table uses yet; dropped after the test."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    yield name
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(psycopg.sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(psycopg.sql.Identifier(name)))


@pytest.fixture
def db_schema(unmigrated_schema: str, database_url: str) -> str:
    """A freshly migrated schema of the test's own."""
    schema.migrate(database_url, schema=unmigrated_schema)
    return unmigrated_schema


@pytest.fixture
def db(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection for assertions."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        yield conn


@pytest.fixture
def rabbit(rabbitmq_url: str) -> Iterator[Rabbit]:
    reader = Rabbit(rabbitmq_url)
    yield reader
    reader.close()


@pytest.fixture(autouse=True)
def queues(monkeypatch: pytest.MonkeyPatch) -> Iterator[QueueJanitor]:
    """Every queue the test declares, deleted with its .DQ/.XQ afterwards, even when the test failed.

    Dramatiq's RabbitMQ broker creates a queue (and its .DQ and .XQ) on the server in one place,
    ``_ensure_queue``; recording there catches workers, relays and publishers alike.  Queues
    declared by subprocesses are the ``queue_name`` fixture's, registered here too.
    """
    janitor = QueueJanitor(RABBITMQ_URL)
    ensure = RabbitmqBroker._ensure_queue

    def recording(self: RabbitmqBroker, canonical_queue_name: str) -> Any:
        janitor.add(canonical_queue_name)  # before the declare: a half-declared queue is cleaned too
        return ensure(self, canonical_queue_name)

    monkeypatch.setattr(RabbitmqBroker, "_ensure_queue", recording)
    yield janitor
    foreign = janitor.foreign()
    janitor.clean()
    if foreign:
        pytest.fail(
            f"the test declared {foreign} in the shared vhost, which it may not delete; "
            "name its queues from the queue_name fixture (or derive them from it)",
            pytrace=False,
        )


@pytest.fixture
def queue_name(rabbitmq_url: str, queues: QueueJanitor) -> str:
    """A queue name of the test's own; the queue and its .DQ/.XQ are deleted afterwards."""
    name = new_queue_name()
    queues.add(name)
    return name


@pytest.fixture
def broker(rabbitmq_url: str, database_url: str, db_schema: str) -> Iterator[OutboxBroker]:
    """An OutboxBroker on the test's schema, set as Dramatiq's global broker."""
    outbox_broker = OutboxBroker(url=rabbitmq_url, database=database_url, schema=db_schema)
    dramatiq.set_broker(outbox_broker)
    yield outbox_broker
    outbox_broker.close()


@pytest.fixture
def worker(broker: OutboxBroker) -> Iterator[dramatiq.Worker]:
    """An in-process Dramatiq worker on ``broker``, started by the test with ``worker.start()``."""
    instance = dramatiq.Worker(broker, worker_timeout=100, worker_threads=2)
    yield instance
    instance.stop()


@pytest.fixture
def seen() -> Iterator[list[events.Event]]:
    """Every event published during the test, in order."""
    received: list[events.Event] = []
    events.subscribe(received.append)
    try:
        yield received
    finally:
        events.unsubscribe(received.append)


@pytest.fixture
def otel() -> Iterator[Otel]:
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    yield Otel(tracer_provider, exporter, meter_provider, reader)
    tracer_provider.shutdown()
    meter_provider.shutdown()


@pytest.fixture(scope="module")
def http() -> Iterator[Callable[..., None]]:
    """``http(status, retry_after=None)``: a real request that raises requests' real HTTPError."""
    import requests

    with status_server() as base:

        def call(status: int, retry_after: str | None = None) -> None:
            query = f"?retry_after={retry_after}" if retry_after is not None else ""
            requests.get(f"{base}/status/{status}{query}", timeout=5).raise_for_status()

        yield call
