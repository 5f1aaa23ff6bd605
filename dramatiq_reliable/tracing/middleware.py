"""The ``Tracing`` middleware: Dramatiq's hooks wired to the spans, the event bridge and the metrics."""

from __future__ import annotations

import importlib.metadata
import logging
from typing import Any

from dramatiq.broker import Broker, MessageProxy
from dramatiq.message import Message
from dramatiq.middleware import Middleware
from dramatiq.worker import Worker
from opentelemetry import metrics, trace
from opentelemetry.propagators.textmap import TextMapPropagator

from .. import events
from .._checks import check_ms
from ..errors import ConfigurationError
from .bridge import EventBridge
from .metrics import HealthGauges, Instruments
from .propagation import TRACE_CONTEXT_KEY, Propagation
from .relay import RelaySpans
from .spans import SpanRecorder

__all__ = ["Tracing"]

logger = logging.getLogger("dramatiq_reliable.tracing")

_INSTRUMENTATION = "dramatiq_reliable"
# What the API hands out when no SDK is configured: a proxy that records nothing until a real
# provider is set globally (then it is no longer returned), or an explicit no-op.
_NO_OP_TRACER_PROVIDERS: tuple[type, ...] = (trace.ProxyTracerProvider, trace.NoOpTracerProvider)
_NO_OP_METER_PROVIDERS: tuple[type, ...] = (metrics.NoOpMeterProvider,)
try:  # the global proxy's class is not public API: without it, only explicit no-ops are skipped
    from opentelemetry.metrics._internal import _ProxyMeterProvider

    _NO_OP_METER_PROVIDERS += (_ProxyMeterProvider,)
except ImportError:  # pragma: no cover - a future opentelemetry-api
    pass
# Middleware whose after-hooks must run before ours (ours runs last only if we come first).
_MUST_FOLLOW_TRACING = frozenset(
    {
        "ClassifiedRetries",
        "Retries",
        "Idempotency",
        "DeadLetters",
        "Pipelines",
        "Callbacks",
        "AgeLimit",
        "TimeLimit",
        "ShutdownNotifications",
        "CurrentMessage",
    }
)


class Tracing(Middleware):
    """OpenTelemetry spans and metrics for sends, relay publishes and every processing attempt.

    Put it **first** in the middleware list: before-hooks run in list order and after-hooks in
    reverse, so its span then covers every other middleware and its after-hook runs last,
    once ``ClassifiedRetries`` has decided and ``Idempotency`` has skipped or committed.  The
    span's context is attached to the worker thread while the actor runs (so spans the actor
    starts are its children) and always detached in the after-hook, also when another
    middleware's hook raised, so nothing leaks from one message into the next.

    It works in producers that never start a worker (only the enqueue hooks run there), in
    workers, and in relay processes: the relay's per-message ``send`` spans come from the
    ``outbox.batch_published`` event, which any constructed ``Tracing`` receives, so a
    stand-alone relay process only needs ``Tracing()`` built once after the SDK is set up.

    Parameters:
      tracer_provider, meter_provider: default to the global ones, looked up when used, so
        the SDK may be configured after this middleware is built.
      propagator: how the creation context is written into ``options["trace_context"]``;
        defaults to the global propagator (W3C trace context and baggage unless configured).
      health_metrics: register the observable gauges (outbox backlog and age, dead letters,
        queue depth).  Each process that has them reads Postgres (and RabbitMQ) once per
        ``health_cache_ms`` at most, whatever the scrape rate; turn them off in all but a few
        processes of a large fleet.
      queue_depth: include RabbitMQ queue depths in the gauges (one dedicated connection).
      health_cache_ms: how long one health reading serves the gauges.

    >>> broker = OutboxBroker(url=..., database=..., middleware=build_middleware(
    ...     middleware=[Tracing(), Idempotency()]))                          # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        tracer_provider: trace.TracerProvider | None = None,
        meter_provider: metrics.MeterProvider | None = None,
        propagator: TextMapPropagator | None = None,
        health_metrics: bool = True,
        queue_depth: bool = True,
        health_cache_ms: int = 10_000,
    ) -> None:
        if tracer_provider is not None and not callable(getattr(tracer_provider, "get_tracer", None)):
            raise ConfigurationError(
                f"tracer_provider must be an OpenTelemetry TracerProvider or None, got {tracer_provider!r}"
            )
        if meter_provider is not None and not callable(getattr(meter_provider, "get_meter", None)):
            raise ConfigurationError(
                f"meter_provider must be an OpenTelemetry MeterProvider or None, got {meter_provider!r}"
            )
        if propagator is not None and not callable(getattr(propagator, "inject", None)):
            raise ConfigurationError(f"propagator must be a TextMapPropagator or None, got {propagator!r}")
        for name, flag in (("health_metrics", health_metrics), ("queue_depth", queue_depth)):
            if not isinstance(flag, bool):
                raise ConfigurationError(f"{name} must be True or False, got {flag!r}")
        check_ms("health_cache_ms", health_cache_ms, minimum=0, fix="10000 is the default")
        self.tracer_provider = tracer_provider
        self.meter_provider = meter_provider
        self.propagator = propagator
        self.health_metrics = health_metrics
        self.queue_depth = queue_depth
        self.health_cache_ms = health_cache_ms

        version = _version()
        # With no provider given these are proxies that follow the global provider, even one
        # set after this middleware was built.
        tracer = trace.get_tracer(_INSTRUMENTATION, version, tracer_provider=tracer_provider)
        meter = metrics.get_meter(_INSTRUMENTATION, version, meter_provider=meter_provider)
        instruments = Instruments.create(meter)
        propagation = Propagation(propagator)
        self._broker: Broker | None = None
        self._spans = SpanRecorder(tracer, propagation, instruments)
        self._gauges = (
            HealthGauges(meter, broker=lambda: self._broker, queue_depth=queue_depth, cache_ms=health_cache_ms)
            if health_metrics
            else None
        )
        self._bridge = EventBridge(tracer, self._spans, RelaySpans(tracer, propagation, instruments), instruments)
        events.subscribe(self._bridge)

    def __repr__(self) -> str:
        return f"Tracing(health_metrics={self.health_metrics!r}, queue_depth={self.queue_depth!r})"

    def close(self) -> None:
        """Stop listening to events, end spans left open and close the gauges' connection."""
        events.unsubscribe(self._bridge)
        self._spans.sweep()
        if self._gauges is not None:
            self._gauges.close()

    # -- broker and lifecycle hooks ----------------------------------------------------------------

    def after_declare_actor(self, broker: Broker, actor: Any) -> None:
        self._broker = broker

    def after_declare_queue(self, broker: Broker, queue_name: str) -> None:
        self._broker = broker

    def before_worker_boot(self, broker: Broker, worker: Worker) -> None:
        self._broker = broker
        names = [type(item).__name__ for item in broker.middleware]
        if self in broker.middleware:
            mine = broker.middleware.index(self)
            early = [name for name in names[:mine] if name in _MUST_FOLLOW_TRACING]
            if early:
                logger.warning(
                    "Tracing comes after %s in the middleware list %r; put it first so its span covers them "
                    "and it sees their retry decision and skips",
                    ", ".join(early),
                    names,
                )

    def before_worker_shutdown(self, broker: Broker, worker: Worker) -> None:
        # Flush now: a worker killed during the graceful wait still exports what it did.
        self._flush()

    def after_worker_shutdown(self, broker: Broker, worker: Worker) -> None:
        self._spans.sweep()
        self._flush()
        if self._gauges is not None:
            self._gauges.disconnect()

    # -- sending -----------------------------------------------------------------------------------

    def before_enqueue(self, broker: Broker, message: Message[Any], delay: int | None) -> None:
        self._broker = broker
        self._spans.start_send(broker, message, delay)

    def after_enqueue(self, broker: Broker, message: Message[Any], delay: int | None) -> None:
        self._spans.end_send(message)

    def after_enqueue_failed(
        self, broker: Broker, message: Message[Any], delay: int | None, *, exception: BaseException
    ) -> None:
        """Called by ``OutboxBroker`` when the outbox insert raised: close the span as an error."""
        self._spans.fail_send(message, exception)

    # -- processing --------------------------------------------------------------------------------

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        self._broker = broker
        if TRACE_CONTEXT_KEY not in message.options and self._no_op():
            # Nothing would be recorded, and the message carries no context for the actor to
            # continue (its baggage, a remote parent): open no span at all.  Checked per message,
            # because the SDK may be configured after this middleware was built.
            self._spans.skip_untraced()
            return
        self._spans.start_attempt(broker, message)

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any | None = None,
        exception: BaseException | None = None,
    ) -> None:
        self._spans.end_attempt(message, exception)

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        self._spans.skip_attempt(message)

    # -- helpers -----------------------------------------------------------------------------------

    def _no_op(self) -> bool:
        """Whether both providers are no-ops: no SDK configured, or no-op providers given."""
        tracer_provider = self.tracer_provider or trace.get_tracer_provider()
        if not isinstance(tracer_provider, _NO_OP_TRACER_PROVIDERS):
            return False
        meter_provider = self.meter_provider or metrics.get_meter_provider()
        return isinstance(meter_provider, _NO_OP_METER_PROVIDERS)

    def _flush(self) -> None:
        for provider in (
            self.tracer_provider or trace.get_tracer_provider(),
            self.meter_provider or metrics.get_meter_provider(),
        ):
            flush = getattr(provider, "force_flush", None)
            if callable(flush):
                try:
                    flush()
                except Exception:
                    logger.warning("could not flush %s at worker shutdown", type(provider).__name__, exc_info=True)

    def _open_spans(self) -> int:
        """Spans this middleware holds open across all threads (for tests: 0 when idle)."""
        return self._spans.open_spans()


def _version() -> str:
    try:
        return importlib.metadata.version("dramatiq-reliable")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - running from a checkout
        return "0"
