"""Test support: a TCP proxy the test owns (for outages), a RabbitMQ reader, OpenTelemetry in memory."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import pika
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind


class TcpProxy:
    """Forwards a local port to ``target``; ``stop()`` closes the port and cuts live connections.

    Tests simulate an outage of Postgres or RabbitMQ with this, never by stopping the server.
    """

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
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

    def take_all(self, queue: str, *, expect: int | None = None, idle_s: float = 0.5) -> list[dict[str, Any]]:
        """Consume (and ack) every message in ``queue``; decoded Dramatiq bodies.

        Stops once nothing arrived for ``idle_s`` and the queue holds nothing ready, and, with
        ``expect``, not before that many bodies arrived (or 60 s passed).  Prefetched messages
        are not counted as ready by RabbitMQ, so only silence proves the queue drained.
        """
        if expect is None and self.count(queue) == 0:
            return []  # also keeps consume() away from a queue that does not exist
        bodies: list[dict[str, Any]] = []
        last = None
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
        self.channel.cancel()
        if last is not None:
            self.channel.basic_ack(last, multiple=True)
        return bodies

    def delete(self, *queues: str) -> None:
        for queue in queues:
            try:
                self.channel.queue_delete(queue)
            except pika.exceptions.ChannelClosedByBroker:
                self.channel = self.connection.channel()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.connection.close()


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
