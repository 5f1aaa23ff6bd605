"""Metrics: the instruments Tracing records into, and the health gauges read from Postgres and RabbitMQ.

The counters and histograms are the messaging conventions' plus ours (retries, dead letters,
duplicates); the spans' code records into them.  The gauges are observable: the SDK calls them
when it collects, and they all read one :class:`~dramatiq_reliable.health.HealthMonitor`
reading, cached for ``cache_ms``, so a scrape costs one backlog query and a few passive declares
however many gauges and queues there are.  Names are in :mod:`.semconv`; ``docs/tracing.md``
has the tables.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable
from typing import Final

from dramatiq.broker import Broker
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Counter, Histogram, Observation

from .._sql import DEFAULT_SCHEMA
from ..autoscale import Autoscale, DrainRate, desired_by_queue
from ..backing import postgres_backed
from ..health import Health, HealthMonitor, QueueHealth
from ..queue_depths import QueueDepths
from . import semconv as names

__all__ = []

# The conventions' advice for messaging durations, in seconds.
DURATION_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)


@dataclasses.dataclass(frozen=True)
class Instruments:
    """The synchronous instruments, created once per ``Tracing`` on its meter."""

    sent: Counter
    consumed: Counter
    process_duration: Histogram
    operation_duration: Histogram
    retries: Counter
    dead_lettered: Counter
    duplicates: Counter
    singleton_held: Counter

    @classmethod
    def create(cls, meter: metrics.Meter) -> Instruments:
        return cls(
            sent=meter.create_counter(
                names.METRIC_CLIENT_SENT_MESSAGES, unit="{message}", description="Messages published to RabbitMQ."
            ),
            consumed=meter.create_counter(
                names.METRIC_CLIENT_CONSUMED_MESSAGES,
                unit="{message}",
                description="Messages delivered to an actor (one per processing attempt).",
            ),
            process_duration=meter.create_histogram(
                names.METRIC_PROCESS_DURATION,
                unit="s",
                description="Duration of processing one message, middleware included.",
                explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
            ),
            operation_duration=meter.create_histogram(
                names.METRIC_CLIENT_OPERATION_DURATION,
                unit="s",
                description="Duration of an outbox insert (create) or a publish to RabbitMQ (send).",
                explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
            ),
            retries=meter.create_counter(
                names.METRIC_RETRIES, unit="{retry}", description="Retries scheduled, by category and reason."
            ),
            dead_lettered=meter.create_counter(
                names.METRIC_DEAD_LETTERED,
                unit="{message}",
                description="Messages that failed for good (dead-lettered), by error type and reason.",
            ),
            duplicates=meter.create_counter(
                names.METRIC_DUPLICATES_SKIPPED,
                unit="{message}",
                description="Messages skipped by Idempotency as duplicates of one that already ran.",
            ),
            singleton_held=meter.create_counter(
                names.METRIC_SINGLETON_HELD,
                unit="{message}",
                description="Runs that found their singleton key held, by action (skipped, postponed, buffered).",
            ),
        )


class HealthGauges:
    """Observable gauges of the outbox backlog and its oldest row, pending dead letters and queue depth.

    The reading is built on first collection from the broker Tracing last saw (an
    Postgres-backed broker gives Postgres, a ``RabbitmqBroker`` the depths), so
    the gauges cost nothing in a process that never collects.  While a service is unreachable
    its gauges report nothing rather than a misleading zero.

    Parameters:
      meter: where the gauges are registered.
      broker: returns the broker to read, or ``None`` while none is known yet.
      queue_depth: also register the RabbitMQ queue-depth gauge (one dedicated connection).
      cache_ms: how long one reading serves every gauge.
    """

    def __init__(
        self, meter: metrics.Meter, *, broker: Callable[[], Broker | None], queue_depth: bool, cache_ms: int
    ) -> None:
        self._broker = broker
        self._queue_depth = queue_depth
        self._cache_ms = cache_ms
        self._monitor: HealthMonitor | None = None
        self._lock = threading.Lock()
        # The default knobs: the Prometheus endpoint ('dramatiq-reliable metrics') takes tuned ones.
        self._autoscale = Autoscale()
        self._drain = DrainRate(window_s=self._autoscale.window_s)
        meter.create_observable_gauge(
            names.METRIC_OUTBOX_BACKLOG,
            callbacks=[self._observe_backlog],
            unit="{message}",
            description="Committed outbox rows due and not yet published, by queue.",
        )
        meter.create_observable_gauge(
            names.METRIC_OUTBOX_OLDEST_AGE,
            callbacks=[self._observe_oldest],
            unit="s",
            description="Age of the oldest unpublished outbox row, by queue (a dead relay shows here).",
        )
        meter.create_observable_gauge(
            names.METRIC_OUTBOX_SCHEDULED,
            callbacks=[self._observe_scheduled],
            unit="{message}",
            description="Outbox rows waiting for their time (delays, retries' backoff), not a backlog, by queue.",
        )
        meter.create_observable_gauge(
            names.METRIC_DEAD_LETTERS_PENDING,
            callbacks=[self._observe_dead_letters],
            unit="{message}",
            description="Dead letters neither replayed nor discarded, by queue.",
        )
        meter.create_observable_gauge(
            names.METRIC_RATE_LIMIT_WAITING,
            callbacks=[self._observe_rate_waiting],
            unit="{message}",
            description="Jobs postponed to a reserved token of a rate-limited key, by key (limited keys only).",
        )
        meter.create_observable_gauge(
            names.METRIC_RATE_LIMIT_PAUSED,
            callbacks=[self._observe_rate_paused],
            unit="s",
            description="How long a rate-limited key stays paused by a provider's 429, by key (0: not paused).",
        )
        meter.create_observable_gauge(
            names.METRIC_RELAY_LAST_PUBLISH_AGE,
            callbacks=[self._observe_relay],
            unit="s",
            description="Seconds since a relay last published an outbox row (its heartbeat while messages flow).",
        )
        meter.create_observable_gauge(
            names.METRIC_QUEUE_OLDEST_AGE,
            callbacks=[self._observe_queue_age],
            unit="s",
            description="How long the oldest ready message of a Postgres queue has waited, by queue.",
        )
        meter.create_observable_gauge(
            names.METRIC_QUEUE_DESIRED_WORKERS,
            callbacks=[self._observe_desired],
            unit="{process}",
            description="Worker processes that would clear the queue within the target wait, by queue "
            "(dramatiq_reliable.autoscale, default knobs).",
        )
        if queue_depth:
            meter.create_observable_gauge(
                names.METRIC_QUEUE_DEPTH,
                callbacks=[self._observe_depth],
                unit="{message}",
                description="Messages waiting, by queue, kind (ready, delayed, xq) and place (messaging.system: "
                "rabbitmq, or postgresql for the Postgres queue table).",
            )

    def disconnect(self) -> None:
        """Close the RabbitMQ connection of the reading (the next collection reopens it)."""
        with self._lock:
            monitor = self._monitor
        if monitor is not None:
            monitor.close()

    def close(self) -> None:
        """Close and forget the reading: a later collection builds it again from the broker."""
        with self._lock:
            monitor, self._monitor = self._monitor, None
        if monitor is not None:
            monitor.close()

    def _health(self) -> Health | None:
        broker = self._broker()
        if broker is None:
            return None
        with self._lock:
            if self._monitor is None:
                self._monitor = self._build_monitor(broker)
            monitor = self._monitor
        return monitor.get() if monitor is not None else None

    def _build_monitor(self, broker: Broker) -> HealthMonitor | None:
        backed = postgres_backed(broker)
        database, schema_name = (backed.database, backed.schema) if backed is not None else (None, DEFAULT_SCHEMA)
        depths = None
        if self._queue_depth and isinstance(broker, RabbitmqBroker):
            depths = QueueDepths(parameters=broker.parameters)
        if database is None and depths is None:
            return None

        def queues() -> Iterable[str]:
            return sorted(broker.get_declared_queues())

        return HealthMonitor(
            database=database,
            schema=schema_name,
            rabbitmq=depths,
            queues=queues,
            ttl_ms=self._cache_ms,
        )

    def _observe_postgres(self, read: Callable[[QueueHealth], float | int | None]) -> list[Observation]:
        """One observation per queue of a number read from Postgres (none while it is unreachable)."""
        health = self._health()
        if health is None or health.postgres_error:
            return []
        return [
            Observation(value, {names.MESSAGING_DESTINATION_NAME: item.queue})
            for item in health.queues
            if (value := read(item)) is not None
        ]

    def _observe_backlog(self, options: CallbackOptions) -> Iterable[Observation]:
        return self._observe_postgres(lambda item: item.outbox_backlog)

    def _observe_oldest(self, options: CallbackOptions) -> Iterable[Observation]:
        return self._observe_postgres(
            lambda item: None if item.outbox_backlog is None else (item.outbox_oldest_age_s or 0.0)
        )

    def _observe_scheduled(self, options: CallbackOptions) -> Iterable[Observation]:
        return self._observe_postgres(lambda item: item.outbox_scheduled)

    def _observe_dead_letters(self, options: CallbackOptions) -> Iterable[Observation]:
        return self._observe_postgres(lambda item: item.dead_letters)

    def _observe_relay(self, options: CallbackOptions) -> Iterable[Observation]:
        health = self._health()
        if health is None or health.relay_last_publish_age_s is None:
            return []
        return [Observation(health.relay_last_publish_age_s)]

    def _observe_queue_age(self, options: CallbackOptions) -> Iterable[Observation]:
        return self._observe_postgres(lambda item: item.queue_oldest_age_s)

    def _observe_desired(self, options: CallbackOptions) -> Iterable[Observation]:
        health = self._health()
        if health is None:
            return []
        desired = desired_by_queue(health, self._autoscale, self._drain)
        return [Observation(value, {names.MESSAGING_DESTINATION_NAME: queue}) for queue, value in desired.items()]

    def _observe_rate_waiting(self, options: CallbackOptions) -> Iterable[Observation]:
        health = self._health()
        if health is None or health.postgres_error:
            return []
        return [Observation(item.waiting, {names.RATE_LIMIT_KEY: item.key}) for item in health.rate_limits]

    def _observe_rate_paused(self, options: CallbackOptions) -> Iterable[Observation]:
        health = self._health()
        if health is None or health.postgres_error:
            return []
        now_ms = health.collected_at * 1000
        return [
            Observation(max(0.0, (item.paused_until_ms or 0) - now_ms) / 1000, {names.RATE_LIMIT_KEY: item.key})
            for item in health.rate_limits
        ]

    def _observe_depth(self, options: CallbackOptions) -> Iterable[Observation]:
        # One point per place that was read (RabbitMQ, the Postgres queue table), so a place that
        # is down hides only its own part: a dashboard sums the places.
        health = self._health()
        if health is None:
            return []
        observations = []
        for item in health.queues:
            for system, counts in (
                (names.SYSTEM_RABBITMQ, item.in_rabbitmq),
                (names.SYSTEM_POSTGRESQL, item.in_postgres),
            ):
                if counts is None:
                    continue
                for kind, value in (("ready", counts.depth), ("delayed", counts.delayed), ("xq", counts.xq)):
                    attributes = {
                        names.MESSAGING_DESTINATION_NAME: item.queue,
                        names.QUEUE_KIND: kind,
                        names.MESSAGING_SYSTEM: system,
                    }
                    observations.append(Observation(value, attributes))
        return observations
