"""The Prometheus endpoint: every queue's health numbers and its desired workers, one reading a scrape.

Needs the ``prometheus`` extra (``prometheus-client``).  :class:`HealthCollector` turns one
:class:`~dramatiq_reliable.health.HealthMonitor` reading into gauges, so a scrape costs one set
of health queries (and the reading is cached for the monitor's ``ttl_ms``) however many gauges
and queues there are; :class:`MetricsServer` serves it over HTTP, on loopback unless told
otherwise.  ``dramatiq-reliable metrics`` runs one.

**Why a process of its own, and no per-worker counters.**  The numbers are the fleet's: they are
read from Postgres and RabbitMQ, which every worker process shares, so one small process serves
them for all.  Dramatiq forks several worker processes; an endpoint inside each would report the
same queue N times (and Prometheus would sum it), and per-process counters would need
prometheus-client's multiprocess mode (a shared directory of memory-mapped files, wiped at each
deploy).  The per-process counters and histograms (messages consumed, durations, retries) are
the :class:`~dramatiq_reliable.Tracing` middleware's OpenTelemetry instruments, which an OTel
collector aggregates across processes.  So this endpoint is multi-process safe by construction:
it lives in none of the worker processes.

>>> monitor = HealthMonitor(database="postgresql://app@localhost/app", queues=lambda: ["default"])  # doctest: +SKIP
>>> with MetricsServer(monitor, port=9191):  # doctest: +SKIP
...     ...  # http://127.0.0.1:9191/metrics
"""

from __future__ import annotations

import errno
import socket
import threading
import time
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Final

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector, CollectorRegistry

from ._checks import check_int, check_text
from .autoscale import Autoscale, DrainRate, desired_by_queue
from .errors import ConfigurationError
from .health import Health, HealthMonitor, QueueHealth

__all__ = ["METRIC_NAMES", "HealthCollector", "MetricsServer"]

_PREFIX: Final = "dramatiq_reliable_"

# (name, help, the number of a queue, or None when it is unknown): one gauge each, labelled by queue.
_QUEUE_GAUGES: Final[tuple[tuple[str, str, Callable[[QueueHealth], float | None]], ...]] = (
    ("queue_depth", "Messages waiting to run (Postgres queue table and RabbitMQ together).", lambda q: q.depth),
    ("queue_delayed", "Messages waiting for their time (.DQ, Postgres rows not yet due).", lambda q: q.delayed),
    ("queue_xq", "Failed messages kept by the broker (.XQ).", lambda q: q.xq),
    (
        "queue_oldest_age_seconds",
        "How long the oldest ready message has waited (Postgres queues only).",
        lambda q: q.queue_oldest_age_s,
    ),
    ("queue_consumers", "Consumers of the RabbitMQ queue (about one per worker process).", lambda q: q.consumers),
    ("outbox_backlog", "Committed outbox rows due and not yet published.", lambda q: q.outbox_backlog),
    (
        "outbox_oldest_age_seconds",
        "Age of the oldest unpublished outbox row (0 with none; a dead relay shows here).",
        lambda q: None if q.outbox_backlog is None else (q.outbox_oldest_age_s or 0.0),
    ),
    (
        "outbox_scheduled",
        "Outbox rows waiting for their due time (delays, retries' backoff).",
        lambda q: q.outbox_scheduled,
    ),
    ("dead_letters", "Dead letters neither replayed nor discarded.", lambda q: q.dead_letters),
    ("retries_waiting", "Retries scheduled and not yet due.", lambda q: q.retries_waiting),
)

#: Every metric name the endpoint can export (dashboards and alert rules are checked against it).
METRIC_NAMES: Final[frozenset[str]] = frozenset(
    {_PREFIX + name for name, _, _ in _QUEUE_GAUGES}
    | {
        _PREFIX + name
        for name in (
            "desired_workers",
            "rate_limited_keys",
            "rate_limit_waiting",
            "rate_limit_paused_seconds",
            "up",
            "reading_age_seconds",
            "relay_last_publish_age_seconds",
        )
    }
)


class HealthCollector(Collector):
    """A prometheus-client collector reading one :class:`HealthMonitor` reading per scrape.

    Numbers that could not be read (a service down, a table missing) are left out rather than
    reported as zero, and ``dramatiq_reliable_up{service=...}`` says which service answered, so an
    alert on a missing series and one on ``up == 0`` both fire while the database is down.

    Parameters:
      monitor: the cached reading.
      autoscale: the knobs of the ``desired_workers`` gauge (see :mod:`dramatiq_reliable.autoscale`).
    """

    def __init__(self, monitor: HealthMonitor, *, autoscale: Autoscale | None = None) -> None:
        self.monitor = monitor
        self.autoscale = autoscale or Autoscale()
        self._drain = DrainRate(window_s=self.autoscale.window_s)

    def collect(self) -> Iterator[Metric]:
        health = self.monitor.get()
        yield from self._services(health)
        if health is None:
            return
        for name, text, read in _QUEUE_GAUGES:
            gauge = GaugeMetricFamily(_PREFIX + name, text, labels=["queue"])
            for item in health.queues:
                value = read(item)
                if value is not None:
                    gauge.add_metric([item.queue], float(value))
            yield gauge
        desired = GaugeMetricFamily(
            _PREFIX + "desired_workers",
            "Worker processes that would clear the queue within the target wait (see docs/metrics.md).",
            labels=["queue"],
        )
        for queue, value in desired_by_queue(health, self.autoscale, self._drain).items():
            desired.add_metric([queue], value)
        yield desired
        relay = GaugeMetricFamily(
            _PREFIX + "relay_last_publish_age_seconds",
            "Seconds since a relay last published an outbox row (the relay's heartbeat while messages flow).",
        )
        if health.relay_last_publish_age_s is not None:
            relay.add_metric([], health.relay_last_publish_age_s)
        yield relay
        yield from self._rate_limits(health)

    def _services(self, health: Health | None) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            _PREFIX + "up", "1 when the service answered the last reading, else 0.", labels=["service"]
        )
        if self.monitor.database is not None:
            up.add_metric(["postgres"], float(health is not None and health.postgres_error is None))
        if self.monitor.rabbitmq is not None and (health is None or health.rabbitmq_skipped is None):
            up.add_metric(["rabbitmq"], float(health is not None and health.rabbitmq_error is None))
        yield up
        if health is not None:
            age = GaugeMetricFamily(_PREFIX + "reading_age_seconds", "How old the cached health reading is.")
            age.add_metric([], max(0.0, time.time() - health.collected_at))
            yield age

    def _rate_limits(self, health: Health) -> Iterator[Metric]:
        if health.postgres_error is not None:
            return
        count = GaugeMetricFamily(
            _PREFIX + "rate_limited_keys", "Rate-limited keys limited now (paused, slowed or with jobs waiting)."
        )
        count.add_metric([], float(len(health.rate_limits)))
        yield count
        waiting = GaugeMetricFamily(
            _PREFIX + "rate_limit_waiting", "Jobs postponed to a reserved token of a key.", labels=["key"]
        )
        paused = GaugeMetricFamily(
            _PREFIX + "rate_limit_paused_seconds",
            "How long a key stays paused by a provider's 429 (0: not paused).",
            labels=["key"],
        )
        now_ms = health.collected_at * 1000
        for item in health.rate_limits:
            waiting.add_metric([item.key], float(item.waiting))
            paused.add_metric([item.key], max(0.0, (item.paused_until_ms or 0) - now_ms) / 1000)
        yield waiting
        yield paused


class MetricsServer:
    """An HTTP server for Prometheus on ``host:port`` (``/metrics``), serving a :class:`HealthCollector`.

    Bound to loopback by default: the page names queues and rate-limited keys, so listening on
    other interfaces (``host="0.0.0.0"`` in a container, where the pod network is the boundary)
    is a choice to make.  A port already in use raises
    :class:`~dramatiq_reliable.errors.ConfigurationError` naming the port and the fix; ``port=0``
    picks a free one (:attr:`port` says which).  The server runs on a daemon thread until
    :meth:`close`, which also closes the monitor's RabbitMQ connection.

    Parameters:
      monitor: the cached reading to serve.
      host, port: where to listen.
      autoscale: the knobs of the ``desired_workers`` gauge.
    """

    def __init__(
        self,
        monitor: HealthMonitor,
        *,
        host: str = "127.0.0.1",
        port: int = 9191,
        autoscale: Autoscale | None = None,
    ) -> None:
        self.host = check_text("host", host, max_chars=253, fix="e.g. host='127.0.0.1'")
        if not host:
            raise ConfigurationError("host is empty; give an address to listen on, e.g. host='127.0.0.1'")
        requested = check_int("port", port, minimum=0, maximum=65535, fix="e.g. port=9191 (0 picks a free port)")
        self.monitor = monitor
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(HealthCollector(monitor, autoscale=autoscale))
        try:
            self._server, self._thread = start_http_server(requested, addr=host, registry=self.registry)
        except OSError as error:
            raise _bind_error(host, requested, error) from error
        self.port: int = self._server.server_port
        self._closed = threading.Event()

    def close(self) -> None:
        """Stop serving and release the port (idempotent)."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
        self.monitor.close()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


def _bind_error(host: str, port: int, error: OSError) -> ConfigurationError:
    where = f"{host}:{port}"
    if error.errno == errno.EADDRINUSE:
        return ConfigurationError(
            f"port {port!r} on {host!r} is already in use; stop what listens on {where} "
            f"(e.g. another 'dramatiq-reliable metrics') or pick another with --port / port="
        )
    if error.errno == errno.EACCES:
        return ConfigurationError(f"not allowed to listen on {where}; pick a port above 1023 with --port / port=")
    if error.errno == errno.EADDRNOTAVAIL or isinstance(error, socket.gaierror):
        return ConfigurationError(
            f"cannot listen on {host!r}: no such address on this machine; give one of its addresses, e.g. 127.0.0.1"
        )
    return ConfigurationError(f"cannot listen on {where}: {error.strerror or error}; check --host and --port")
