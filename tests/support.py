"""Test support: a TCP proxy the test owns (for outages), a RabbitMQ reader, OpenTelemetry in memory."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse, urlsplit, urlunsplit

import dramatiq.common
import pika
import psycopg
from dramatiq.broker import MessageProxy
from dramatiq.common import dq_name, xq_name
from dramatiq.message import Message
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from dramatiq_reliable.dead_letters import DeadLetters

_DEFAULT_PORTS = {"postgresql": 5432, "postgres": 5432, "amqp": 5672, "amqps": 5671}


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released): connecting to it is refused."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def server_pid(conn: psycopg.Connection[Any]) -> int:
    """The Postgres server process ``conn``'s open transaction runs on, to terminate it.

    Not ``conn.info.backend_pid``: behind PgBouncer that is the pooler's own number, and the
    server process changes between transactions; inside one it stays, so ask the server.
    """
    row = conn.execute("SELECT pg_backend_pid()").fetchone()
    assert row is not None
    return int(row[0])


def server_address(url: str) -> tuple[str, int]:
    """The ``(host, port)`` a Postgres or AMQP URL (or a libpq ``key=value`` string) connects to."""
    if "://" not in url:
        params = psycopg.conninfo.conninfo_to_dict(url)
        return str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432)
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or _DEFAULT_PORTS[parts.scheme]


def proxied(url: str, port: int, **query: str) -> str:
    """``url`` pointed at ``127.0.0.1:port`` instead of its server: user, password, database or
    vhost and query are kept (so tests honour ``DATABASE_URL``/``RABBITMQ_URL``); ``query``
    adds or replaces query parameters (``connect_timeout="2"``, ``connection_attempts="1"``).

    >>> proxied("postgresql://app:pw@db:5433/shop?sslmode=disable", 4000)
    'postgresql://app:pw@127.0.0.1:4000/shop?sslmode=disable'
    >>> proxied("amqp://guest:guest@mq/dr_alt", 4001, connection_attempts="1")
    'amqp://guest:guest@127.0.0.1:4001/dr_alt?connection_attempts=1'
    """
    if "://" not in url:  # a libpq key=value string
        params = psycopg.conninfo.conninfo_to_dict(url)
        params.pop("hostaddr", None)
        params.update(query, host="127.0.0.1", port=str(port))
        return psycopg.conninfo.make_conninfo("", **params)
    parts = urlsplit(url)
    userinfo, at, _host = parts.netloc.rpartition("@")
    pairs = [pair for pair in parts.query.split("&") if pair and pair.split("=", 1)[0] not in query]
    pairs += [f"{key}={value}" for key, value in query.items()]
    netloc = f"{userinfo}{at}127.0.0.1:{port}"
    return urlunsplit((parts.scheme, netloc, parts.path, "&".join(pairs), parts.fragment))


class TcpProxy:
    """Forwards a local port to ``target``; ``stop()`` closes the port and cuts live connections.

    Tests simulate an outage of Postgres or RabbitMQ with this, never by stopping the server.
    ``TcpProxy.to(url)`` targets the server ``url`` names, and ``proxy.url`` is ``url`` through
    the proxy (same user, database or vhost, query).
    """

    @classmethod
    def to(cls, url: str, **query: str) -> TcpProxy:
        """A proxy (not started) in front of the server of ``url``; ``.url`` connects through it."""
        proxy = cls(*server_address(url))
        proxy.url = proxied(url, proxy.port, **query)
        return proxy

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = ""
        self._server: socket.socket | None = None
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()

    def start(self) -> TcpProxy:
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", self.port))
        server.listen(64)
        self._server = server
        threading.Thread(target=self._accept, args=(server,), daemon=True).start()
        return self

    def stop(self) -> None:
        """Close the listening port and every forwarded connection (an outage)."""
        server, self._server = self._server, None
        if server is not None:
            with contextlib.suppress(OSError):
                server.shutdown(socket.SHUT_RDWR)
            server.close()
        with self._lock:
            sockets, self._sockets = self._sockets, set()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets |= {client, upstream}
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)


class Rabbit:
    """Reads what reached RabbitMQ, over its own connection."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.connection = pika.BlockingConnection(pika.URLParameters(url))
        self.channel = self.connection.channel()

    def count(self, queue: str) -> int:
        try:
            return int(self.channel.queue_declare(queue=queue, passive=True).method.message_count)
        except pika.exceptions.ChannelClosedByBroker:
            self.channel = self.connection.channel()
            return 0

    def exists(self, queue: str) -> bool:
        try:
            self.channel.queue_declare(queue=queue, passive=True)
        except pika.exceptions.ChannelClosedByBroker:
            self.channel = self.connection.channel()
            return False
        return True

    def take_all(self, queue: str, *, expect: int | None = None, idle_s: float = 0.5) -> list[dict[str, Any]]:
        """Consume (and ack) every message in ``queue``; decoded Dramatiq bodies.

        Stops once nothing arrived for ``idle_s`` and the queue holds nothing ready, and, with
        ``expect``, not before that many bodies arrived (or 60 s passed).  Prefetched messages
        are not counted as ready by RabbitMQ, so only silence proves the queue drained.
        """
        if expect is None and self.count(queue) == 0:
            return []  # also keeps consume() away from a queue that does not exist
        bodies: list[dict[str, Any]] = []
        last = acked = None
        deadline = time.monotonic() + 60
        self.channel.basic_qos(prefetch_count=1000)
        for method, _props, body in self.channel.consume(queue, inactivity_timeout=idle_s):
            if method is None:
                drained = self.count(queue) == 0
                if drained and (expect is None or len(bodies) >= expect or time.monotonic() > deadline):
                    break
                continue
            bodies.append(json.loads(body))
            last = method.delivery_tag
            if len(bodies) % 500 == 0:
                self.channel.basic_ack(last, multiple=True)
                acked = last
        # Each tag is acked once, before cancel() (which requeues what is unacked): acking a tag
        # twice closes the channel (406 unknown delivery tag) under the next call, and a delete
        # that then failed unnoticed left the worker-relay test's queue behind on every run.
        if last is not None and last != acked:
            self.channel.basic_ack(last, multiple=True)
        self.channel.cancel()
        return bodies

    def delete(self, *queues: str) -> None:
        """Delete each queue; one that does not exist is no error, any other refusal is raised."""
        for queue in queues:
            try:
                self.channel.queue_delete(queue)
            except pika.exceptions.ChannelClosedByBroker as error:
                self.channel = self.connection.channel()
                if error.reply_code != 404:
                    raise

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.connection.close()


TEST_QUEUE = re.compile(r"q_[0-9a-f]{12}")

#: Every queue name handed out this session -> the test it was handed to.
ISSUED: dict[str, str] = {}
#: Every queue a test of this session declared through Dramatiq or registered with the janitor.
DECLARED: set[str] = set()


def new_queue_name() -> str:
    """A queue name of the test's own (``q_`` and 12 hex digits); names derived from it stay its own."""
    name = f"q_{uuid.uuid4().hex[:12]}"
    ISSUED[name] = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
    return name


def vhost_of(url: str) -> str:
    """The virtual host an AMQP URL names (``/`` for ``%2F`` or none)."""
    return str(pika.URLParameters(url).virtual_host)


def list_queues(url: str) -> list[str] | None:
    """Every queue of the URL's vhost, from ``rabbitmqctl``; None where it cannot tell (no
    rabbitmqctl here, no right to run it, or a server that is not this machine's)."""
    host = urlsplit(url).hostname or "127.0.0.1"
    if host not in ("127.0.0.1", "localhost", "::1") or shutil.which("rabbitmqctl") is None:
        return None
    try:
        result = subprocess.run(
            ["rabbitmqctl", "-q", "list_queues", "-p", vhost_of(url), "name", "--no-table-headers"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if result.returncode != 0:
        return None
    return [line.strip() for line in result.stdout.splitlines() if line.strip()]


def left_behind(url: str, issued: dict[str, str], declared: set[str]) -> tuple[list[str], str]:
    """The queues of this session's tests that still exist, and how that was found out.

    A queue is the session's when its name starts with a name ``new_queue_name()`` handed out
    (``issued``), so names derived in subprocesses count (``f"{queue_name}_w"``).  With
    ``rabbitmqctl`` every queue of the vhost is seen; without it only the names the session knows
    (``declared``, and each issued name with its ``.DQ``/``.XQ``) are asked about, passively.
    """
    listed = list_queues(url)
    how = "rabbitmqctl list_queues"
    if listed is None:
        how = "a passive declare of each name the tests declared (no rabbitmqctl for this server)"
        known = declared | {n for name in issued for n in (name, dq_name(name), xq_name(name))}
        rabbit = Rabbit(url)
        try:
            listed = [name for name in sorted(known) if len(name.encode()) <= 255 and rabbit.exists(name)]
        finally:
            rabbit.close()
    ours = []
    for name in listed:
        base = TEST_QUEUE.match(name)
        if base is not None and base.group() in issued:
            ours.append(name)
    return sorted(ours), how


class QueueJanitor:
    """Records every queue a test declares, and deletes them (with their ``.DQ`` and ``.XQ``) after it.

    The shared vhost is used by other suites at the same time: only queues whose names come from
    ``new_queue_name()`` (or are derived from one, ``f"{queue_name}_other"``) are the test's to
    delete.  ``foreign()`` lists the others the test declared, so the fixture can fail the test.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self.names: set[str] = set()
        self._lock = threading.Lock()

    def add(self, name: str) -> None:
        with self._lock:
            self.names.add(dramatiq.common.q_name(name))
            DECLARED.add(dramatiq.common.q_name(name))

    def foreign(self) -> list[str]:
        """Queues the test declared that are not its own and now exist on the server."""
        with self._lock:
            # A name RabbitMQ refused (over 255 bytes) was never declared; nothing to ask about.
            others = sorted(n for n in self.names if not TEST_QUEUE.match(n) and len(n.encode()) <= 255)
        if not others:
            return []
        rabbit = Rabbit(self.url)
        try:
            return [name for name in others if rabbit.exists(name)]
        finally:
            rabbit.close()

    def clean(self) -> None:
        with self._lock:
            owned = sorted(name for name in self.names if TEST_QUEUE.match(name))
            self.names.clear()
        if not owned:
            return
        rabbit = Rabbit(self.url)
        try:
            rabbit.delete(*(n for name in owned for n in (name, dq_name(name), xq_name(name))))
        finally:
            rabbit.close()


@contextlib.contextmanager
def running(thread_target: Any, stop: Any) -> Iterator[threading.Thread]:
    """Run ``thread_target`` in a thread for the block, then call ``stop`` and join."""
    thread = threading.Thread(target=thread_target, daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        stop()
        thread.join(timeout=30)


@dataclasses.dataclass
class Otel:
    tracer_provider: TracerProvider
    exporter: InMemorySpanExporter
    meter_provider: MeterProvider
    reader: InMemoryMetricReader

    def spans(self, name: str | None = None, kind: SpanKind | None = None) -> list[ReadableSpan]:
        return [
            span
            for span in self.exporter.get_finished_spans()
            if (name is None or span.name == name) and (kind is None or span.kind is kind)
        ]

    def points(self, name: str) -> list[Any]:
        data = self.reader.get_metrics_data()
        return [
            point
            for resource in (data.resource_metrics if data else [])
            for scope in resource.scope_metrics
            for metric in scope.metrics
            if metric.name == name
            for point in metric.data.data_points
        ]

    def total(self, name: str, **attributes: Any) -> float:
        return sum(
            point.value if hasattr(point, "value") else point.count
            for point in self.points(name)
            if all(point.attributes.get(key) == value for key, value in attributes.items())
        )


class _StatusHandler(BaseHTTPRequestHandler):
    """``GET /status/503?retry_after=2`` answers 503 with ``Retry-After: 2``."""

    def do_GET(self) -> None:
        parsed = urlparse(self.path)
        self.send_response(int(parsed.path.rsplit("/", 1)[-1]))
        for value in parse_qs(parsed.query).get("retry_after", []):
            self.send_header("Retry-After", value)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextlib.contextmanager
def status_server() -> Iterator[str]:
    """A local HTTP server answering any status asked for; yields its base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StatusHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def capture_dead_letter(
    broker: Any,
    *,
    actor_name: str = "send_email",
    queue_name: str = "default",
    error: BaseException | None = None,
    sent_days_ago: float = 0,
    args: tuple[Any, ...] = (42,),
    kwargs: dict[str, Any] | None = None,
    options: dict[str, Any] | None = None,
) -> Any:
    """One dead letter, stored as the ``DeadLetters`` middleware stores a message that failed for
    good: the message first sent ``sent_days_ago`` days ago, failing with ``error`` (raised, so it
    carries a real traceback)."""
    message = Message(
        queue_name=queue_name,
        actor_name=actor_name,
        args=args,
        kwargs=kwargs or {},
        options={"retries": 3, **(options or {})},
        message_timestamp=int((time.time() - sent_days_ago * 86400) * 1000),
    )
    proxy = MessageProxy(message)
    try:
        raise error or ValueError("card declined")
    except BaseException as raised:
        proxy.stuff_exception(raised)
    proxy.fail()
    stored = DeadLetters().capture(broker, proxy)
    assert stored is not None
    return stored


def deployed_as(database_url: str, schema: str, sends_to: str) -> None:
    """Make ``schema`` look like a deployment that sent through ``sends_to`` ("outbox" or "queue"):
    its table's id sequence hands out a value, as the first send does, and nothing else changes."""
    import psycopg

    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "SELECT nextval(pg_get_serial_sequence(%s, 'id'))",
            (psycopg.sql.Identifier(schema, sends_to).as_string(conn),),
        )


def send_many(broker: Any, queue_name: str, count: int, **options: Any) -> None:
    """Send ``count`` messages of a do-nothing actor ``<queue_name>_job`` (declared once) to ``queue_name``."""
    import dramatiq

    actor = broker.actors.get(f"{queue_name}_job") or dramatiq.actor(
        lambda: None, actor_name=f"{queue_name}_job", queue_name=queue_name, broker=broker
    )
    for _ in range(count):
        actor.send_with_options(**options)
