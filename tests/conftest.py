"""Fixtures: a fresh Postgres schema and fresh RabbitMQ queue names for every test.

Services come from ``DATABASE_URL`` and ``RABBITMQ_URL`` (default: the local servers).  Each is
probed once, at collection, if a collected test needs it.  A missing service skips the tests that
need it on a laptop; with ``CI=true`` they fail without running.  Either way the run ends with
one line naming the service, the URL (password masked) and the reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import dramatiq
import embedded_postgres  # (first: an embedded Postgres if DATABASE_URL is unset)
import pgbouncer
import pika
import psycopg
import pytest
import rabbitmq_nodes
import support
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from support import TEST_QUEUE, Otel, QueueJanitor, Rabbit, new_queue_name, status_server

from dramatiq_reliable import OutboxBroker, PostgresBroker, WorkerRelay, events, schema
from dramatiq_reliable._util import rabbitmq_reason, redact

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
#: THROUGH_PGBOUNCER=1 (``make test-alt`` sets it): every test's ``database_url`` goes through one
#: PgBouncer in transaction mode started by the session; ``direct_database_url`` stays direct.
THROUGH_PGBOUNCER = os.environ.get("THROUGH_PGBOUNCER", "") == "1"
#: The loopback ports the session's PgBouncer may take (the first free one), so a pooler left
#: running by a killed run is easy to find.  Under pytest-xdist (``make test-alt -n 2``) each
#: worker process has a session of its own and a PgBouncer of its own: worker gwN takes from
#: its own slice, so two workers starting at once never race for one port.
_XDIST_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
PGBOUNCER_PORTS = range(6440 + 10 * _XDIST_WORKER, 6450 + 10 * _XDIST_WORKER)
RABBITMQ_URL = os.environ.get("RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


@dataclasses.dataclass
class _Service:
    """A server the tests need, probed once a session (at collection, for the tests that need it)."""

    name: str  #: "Postgres"
    variable: str  #: the environment variable that points the tests at it
    url: str
    probe: Callable[[str], None]  #: connects once and disconnects; raises when it cannot
    explain: Callable[[BaseException], str]  #: the probe's error in plain words
    reason: str | None = None  #: why it is unreachable (None: reachable or not probed yet)
    probed: bool = False
    needed_by: set[str] = dataclasses.field(default_factory=set)  #: node ids of the tests that need it

    def check(self) -> bool:
        """Probe the server once a session; True when it answered."""
        if not self.probed:
            self.probed = True
            try:
                with _quiet("pika"):
                    self.probe(self.url)
            except Exception as error:
                self.reason = self.explain(error)
        return self.reason is None

    @property
    def message(self) -> str:
        return redact(f"{self.name} is not reachable at {self.url} ({self.reason})")


def _probe_postgres(url: str) -> None:
    with psycopg.connect(url, connect_timeout=5) as conn:
        conn.execute("SELECT 1")


def _probe_rabbitmq(url: str) -> None:
    parameters = pika.URLParameters(url)
    parameters.connection_attempts = 1  # once: a retry would only repeat the reason
    parameters.socket_timeout = 5
    pika.BlockingConnection(parameters).close()


def _postgres_reason(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


@contextlib.contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    """A probe's failure is reported once by us: the client's own error logs would repeat it."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        logger.setLevel(level)


#: The services, by the fixture that gives their URL to a test.
SERVICES = {
    "database_url": _Service("Postgres", "DATABASE_URL", DATABASE_URL, _probe_postgres, _postgres_reason),
    "rabbitmq_url": _Service("RabbitMQ", "RABBITMQ_URL", RABBITMQ_URL, _probe_rabbitmq, rabbitmq_reason),
}
_SKIP_PREFIX = "service unreachable: "
#: The pytest status of a test whose service is missing under CI=true: counted, not detailed.
_MISSING_STATUS = "errors (service missing)"


#: Fixtures that start RabbitMQ nodes of the tests' own: their tests are marked ``cluster``.
_NODE_FIXTURES = frozenset({"rabbitmq_cluster", "healed_cluster", "rabbitmq_short_timeout_node"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test by its folder, so ``-m unit`` runs the tests that need no service; and probe
    each service the collected tests need, once: a test whose service is missing is skipped, or
    with ``CI=true`` fails without running, and the run ends with one line per missing service."""
    for item in items:
        parts = item.path.parts
        for kind in ("unit", "integration", "acceptance", "browser"):
            if kind in parts:
                item.add_marker(getattr(pytest.mark, kind))
        if _NODE_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.cluster)
        session = item.get_closest_marker("needs_session")
        if THROUGH_PGBOUNCER and session is not None:
            # Listed in docs/testing.md: what the test exercises is the session itself.
            item.add_marker(
                pytest.mark.skip(reason=f"needs a Postgres session, not a transaction pooler: {session.args[0]}")
            )
    for item in items:
        for fixture, service in SERVICES.items():
            if fixture in getattr(item, "fixturenames", ()) and not service.check():
                service.needed_by.add(item.nodeid)
                if not IN_CI:
                    item.add_marker(pytest.mark.skip(reason=_SKIP_PREFIX + service.message))
                break


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """With CI=true a test whose service is missing fails at once: no fixture tries to connect again."""
    if IN_CI:
        for service in SERVICES.values():
            if service.reason is not None and item.nodeid in service.needed_by:
                pytest.fail(service.message, pytrace=False)


def pytest_report_teststatus(report: pytest.TestReport) -> tuple[str, str, str] | None:
    """Such a failure is counted apart, without a section of its own per test: the run's summary names
    the service once (``pytest_terminal_summary``)."""
    if report.when == "setup" and report.failed and _missing_service_of(report.nodeid) is not None:
        return _MISSING_STATUS, "M", "SERVICE MISSING"
    return None


def _missing_service_of(nodeid: str) -> _Service | None:
    return next((s for s in SERVICES.values() if s.reason is not None and nodeid in s.needed_by), None)


def _unavailable(service: _Service) -> None:
    """A test asked for the service's fixture without being collected as needing it (getfixturevalue)."""
    service.needed_by.add(os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0])
    if IN_CI:
        pytest.fail(f"{service.message}; CI=true, so this is a failure, not a skip", pytrace=False)
    pytest.skip(_SKIP_PREFIX + service.message)


#: The queues this session's tests left behind (found at the session's end), and how they were found.
_LEFT_BEHIND: list[str] = []
_LEFT_BEHIND_HOW: list[str] = []


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """No test may leave a queue behind: each test's queues are deleted after it (the ``queues``
    fixture), so any of them still there at the end was declared where the janitor did not see it
    (a subprocess, say).  They are deleted now; with CI=true the session fails, naming each queue
    and the test it came from."""
    if not support.ISSUED or not SERVICES["rabbitmq_url"].check():
        return
    left, how = support.left_behind(RABBITMQ_URL, support.ISSUED, support.DECLARED)
    if not left:
        return
    _LEFT_BEHIND.extend(left)
    _LEFT_BEHIND_HOW.append(how)
    rabbit = Rabbit(RABBITMQ_URL)
    try:
        rabbit.delete(*left)
    finally:
        rabbit.close()
    if IN_CI:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _test_of(queue: str) -> str:
    base = TEST_QUEUE.match(queue)
    return support.ISSUED.get(base.group(), "?") if base is not None else "?"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """One line per missing service, naming it, the URL tried (password masked) and why; and one
    line naming the queues tests left behind, if any."""
    if _LEFT_BEHIND:
        origins = ", ".join(f"{name} (from {_test_of(name)})" for name in _LEFT_BEHIND)
        terminalreporter.write_line(
            f"{len(_LEFT_BEHIND)} queue{'s' if len(_LEFT_BEHIND) != 1 else ''} left behind by tests in vhost "
            f"{support.vhost_of(RABBITMQ_URL)!r} (found with {_LEFT_BEHIND_HOW[0]}), deleted now: {origins}; "
            "a test must delete every queue it declares: register names a subprocess declares with the "
            "queues fixture (queues.add(name))" + ("; CI=true, so the run fails" if IN_CI else ""),
            red=IN_CI,
            yellow=not IN_CI,
            bold=True,
        )
    if embedded_postgres.embedded_url is not None:
        terminalreporter.write_line(
            f"DATABASE_URL is not set: the tests ran on an embedded Postgres at {embedded_postgres.embedded_url}"
        )
    for service in SERVICES.values():
        if service.reason is None or not service.needed_by:
            continue
        count = len(service.needed_by)
        tests = f"{count} test{'s' if count != 1 else ''}"
        if IN_CI:
            terminalreporter.write_line(
                f"{service.message}: CI=true, so the {tests} that need it failed without running; start it, "
                f"or point {service.variable} at it",
                red=True,
                bold=True,
            )
        else:
            terminalreporter.write_line(
                f"{tests} skipped: {service.message}; start it, or point the tests at it with "
                f"{service.variable}=... (CI=true fails instead)",
                yellow=True,
                bold=True,
            )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test marked ``pooler`` runs twice: on Postgres directly and through a PgBouncer in
    transaction mode (its ``database_url`` is then the pooler's; tests/pgbouncer.py).  With
    THROUGH_PGBOUNCER=1 every test already runs through the pooler: once is enough."""
    fixtures = metafunc.fixturenames
    if (
        not THROUGH_PGBOUNCER
        and metafunc.definition.get_closest_marker("pooler")
        and "database_url" in fixtures
        and "pgbouncer_url" not in fixtures
    ):
        metafunc.parametrize("database_url", ["direct", "pgbouncer"], indirect=True, scope="session")


@pytest.fixture(scope="session")
def direct_database_url() -> str:
    """Postgres itself, never through a pooler: for what needs a session (``LISTEN``, a lock the
    test holds, a backend it kills) and for ``listen_database=``."""
    service = SERVICES["database_url"]
    if not service.check():
        _unavailable(service)
    return service.url


@pytest.fixture(scope="session")
def listen_url(direct_database_url: str) -> str | None:
    """What a relay or ``PostgresBroker`` a test builds gets as ``listen_database=``: the direct
    URL through the pooler (as production.md tells users), None directly (it listens on ``database``)."""
    return direct_database_url if THROUGH_PGBOUNCER else None


@pytest.fixture(scope="session")
def database_url(request: pytest.FixtureRequest) -> str:
    service = SERVICES["database_url"]
    if not service.check():
        _unavailable(service)
    if getattr(request, "param", "pgbouncer" if THROUGH_PGBOUNCER else "direct") == "pgbouncer":
        return str(request.getfixturevalue("pgbouncer_url"))
    return service.url


@pytest.fixture(scope="session")
def pgbouncer_url() -> Iterator[str]:
    """The test database through one PgBouncer in transaction mode, shared by the session."""
    service = SERVICES["database_url"]
    if not service.check():
        _unavailable(service)
    ports = PGBOUNCER_PORTS if THROUGH_PGBOUNCER else None
    with pgbouncer.pgbouncer(
        service.url, pool_size=10, ports=ports, max_client_conn=500 if THROUGH_PGBOUNCER else 50
    ) as url:
        if not THROUGH_PGBOUNCER:
            yield url
            return
        with _unprepared_test_connections():
            yield url


@contextlib.contextmanager
def _unprepared_test_connections() -> Iterator[None]:
    """Connections the tests open themselves (``psycopg.connect`` called from a file under
    ``tests/``) prepare no statements: behind the pooler a prepared statement of the test's own
    would break the test, not the library.  The library's connections are left as they are, so a
    part of it that prepares behind the pooler still fails."""
    connect = psycopg.Connection.connect.__func__
    tests_folder = os.path.dirname(os.path.abspath(__file__)) + os.sep

    def unprepared(cls: type[psycopg.Connection[Any]], *args: Any, **kwargs: Any) -> psycopg.Connection[Any]:
        conn = connect(cls, *args, **kwargs)
        if sys._getframe(1).f_code.co_filename.startswith(tests_folder) and "prepare_threshold" not in kwargs:
            conn.prepare_threshold = None
        return conn

    patched = classmethod(unprepared)
    original = psycopg.Connection.__dict__["connect"]
    psycopg.Connection.connect = patched
    psycopg.connect = psycopg.Connection.connect
    try:
        yield
    finally:
        psycopg.Connection.connect = original
        psycopg.connect = psycopg.Connection.connect


@pytest.fixture(scope="session")
def rabbitmq_url() -> str:
    service = SERVICES["rabbitmq_url"]
    if not service.check():
        _unavailable(service)
    return service.url


def _nodes_or_fail() -> None:
    """Extra RabbitMQ nodes need the machine's install and root: skip without them, fail in CI."""
    reason = rabbitmq_nodes.available()
    if reason is not None:
        (pytest.fail if IN_CI else pytest.skip)(f"cannot start RabbitMQ test nodes: {reason}")


@pytest.fixture(scope="session")
def rabbitmq_cluster() -> Iterator[rabbitmq_nodes.RabbitCluster]:
    """Three RabbitMQ nodes of the tests' own, clustered (tests/rabbitmq_nodes.py); killed at the end.

    Shared by the session: a test that stops or kills a node calls ``rabbitmq_cluster.heal()``
    before it ends (the ``healed_cluster`` fixture does it for you).
    """
    _nodes_or_fail()
    with rabbitmq_nodes.cluster(3) as nodes:
        yield nodes


@pytest.fixture
def healed_cluster(rabbitmq_cluster: rabbitmq_nodes.RabbitCluster) -> Iterator[rabbitmq_nodes.RabbitCluster]:
    """The session's cluster, with every node running again after the test (even when it failed)."""
    yield rabbitmq_cluster
    rabbitmq_cluster.heal()


@pytest.fixture(scope="session")
def rabbitmq_short_timeout_node() -> Iterator[rabbitmq_nodes.RabbitNode]:
    """A RabbitMQ node whose ``consumer_timeout`` is 3 s, checked every second.

    A delivery held unacked for about 3-4 s gets its channel closed with ``PRECONDITION_FAILED``,
    as a 30-minute job or delay would on a default server.
    """
    _nodes_or_fail()
    with rabbitmq_nodes.single_node(consumer_timeout_ms=3000, channel_tick_ms=1000) as node:
        yield node


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
def db(direct_database_url: str) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection for assertions, directly on Postgres (never through the pooler:
    what a test checks or sets up for itself is not what the library does through it)."""
    with psycopg.connect(direct_database_url, autocommit=True) as conn:
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
def pg_broker(database_url: str, db_schema: str, listen_url: str | None) -> Iterator[PostgresBroker]:
    """A PostgresBroker on the test's schema (a module may define its own, with other options)."""
    broker = PostgresBroker(database=database_url, schema=db_schema, listen_database=listen_url)
    yield broker
    broker.close()


@pytest.fixture(params=["postgres", "outbox"])
def backed_broker(request: pytest.FixtureRequest, database_url: str, db_schema: str) -> Iterator[Any]:
    """A Postgres-backed broker of each kind on the test's schema, bare: the module adds its middleware.

    ``PostgresBroker`` first, then an ``OutboxBroker`` whose ``WorkerRelay`` polls every 20 ms.
    ``pytest.mark.parametrize("backed_broker", ["postgres"], indirect=True)`` keeps one kind.
    """
    if request.param == "postgres":
        made: Any = PostgresBroker(database=database_url, schema=db_schema)
    else:
        made = OutboxBroker(url=request.getfixturevalue("rabbitmq_url"), database=database_url, schema=db_schema)
        made.add_middleware(WorkerRelay(poll_interval_ms=20))
    yield made
    made.close()


@pytest.fixture
def backed_queue(backed_broker: Any, request: pytest.FixtureRequest) -> str:
    """The queue for ``backed_broker``'s actors: on RabbitMQ the test's own (deleted afterwards)."""
    if isinstance(backed_broker, OutboxBroker):
        return str(request.getfixturevalue("queue_name"))
    return "backed"


@pytest.fixture
def backed_worker(backed_broker: Any) -> Iterator[dramatiq.Worker]:
    """An in-process worker on ``backed_broker`` (4 threads), started by the test with ``start()``."""
    instance = dramatiq.Worker(backed_broker, worker_timeout=50, worker_threads=4)
    yield instance
    instance.stop()


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
