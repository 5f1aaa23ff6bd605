"""Tracing: one OpenTelemetry trace per job, from the request through the outbox, the relay and every retry.

The :class:`Tracing` middleware follows the OpenTelemetry messaging conventions and uses only
``opentelemetry-api``: without an SDK configured every call is a no-op, so libraries can add
it unconditionally and applications decide what is exported.

Spans (kind, name, when):

* ``PRODUCER  create <queue>``: ``send()`` writing the outbox row, in the caller's trace.  Its
  context is the message's *creation context*, stored in ``message.options["trace_context"]``
  (RabbitMQ carries only the JSON body here, so the options are the envelope).  It is set only
  when absent: a retry, Dramatiq's delay-queue hop and a pipeline's re-enqueue of the same
  message keep the original one, so every attempt lands in the same trace.
* ``CLIENT    send <queue>``: the relay publishing the row to RabbitMQ (one span per message,
  child of and linked to the creation context, timed by the batch), and the worker's consumer
  thread moving a due delayed message from ``<queue>.DQ`` to ``<queue>``.
* ``CONSUMER  process <queue>``: one per processing attempt, child of the creation context,
  linked to it and to the previous attempt's span (``options["trace_previous_attempt"]``).
  It records the outcome: error status and ``error.type`` on failure, the retry decision
  (outcome, category, reason, attempt, delay) as attributes and a ``retry.scheduled`` /
  ``retry.gave_up`` event, ``dead_lettered`` when the message failed for good, and every
  event the other middleware emit while it runs (``idempotency.duplicate``, ...).
* ``INTERNAL  dead_letter.stored`` (and any other event emitted right after the attempt, in
  the ack/nack hooks): a short child of the attempt's span.

A replayed dead letter (``options["replay_of"]``) starts a new trace whose first ``process``
span links to the original creation context (``options["trace_origin"]`` afterwards) and to
the last failed attempt.

Metrics: ``messaging.client.sent.messages``, ``messaging.client.consumed.messages``,
``messaging.process.duration`` and ``messaging.client.operation.duration`` from the
conventions, plus ``dramatiq_reliable.retries``, ``dramatiq_reliable.dead_lettered``,
``dramatiq_reliable.duplicates_skipped`` and observable gauges of the outbox backlog and its
oldest row, pending dead letters and RabbitMQ queue depth (read through a cached
:class:`~dramatiq_reliable.status.HealthMonitor`).  ``docs/tracing.md`` has the tables.
"""

from __future__ import annotations

import contextvars
import dataclasses
import importlib.metadata
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final

from dramatiq.broker import Broker, MessageProxy
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.errors import DecodeError
from dramatiq.message import Message
from dramatiq.middleware import Middleware
from dramatiq.worker import ConsumerThread, Worker
from opentelemetry import context as otel_context
from opentelemetry import metrics, propagate, trace
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.propagators.textmap import TextMapPropagator
from opentelemetry.trace import Link, Span, SpanContext, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from . import events
from ._util import check_ms as _check_ms
from ._util import type_name as _type_name
from .errors import ConfigurationError
from .health import Health, HealthMonitor, QueueDepths, QueueHealth
from .outbox.broker import OutboxBroker

__all__ = [
    "PREVIOUS_ATTEMPT_KEY",
    "TRACE_CONTEXT_KEY",
    "TRACE_ORIGIN_KEY",
    "TRACE_REPLAY_KEY",
    "Tracing",
]

logger = logging.getLogger("dramatiq_reliable.tracing")

# -- message options ---------------------------------------------------------------------------

#: The creation context, as the propagator writes it (``{"traceparent": ..., "tracestate": ...}``).
TRACE_CONTEXT_KEY: Final = "trace_context"
#: The span context of the latest processing attempt (W3C ``traceparent``), for the next one's link.
PREVIOUS_ATTEMPT_KEY: Final = "trace_previous_attempt"
#: A replay's original creation context, kept when the replay starts a trace of its own.
TRACE_ORIGIN_KEY: Final = "trace_origin"
#: The replay (``replay_of["count"]``) whose trace was started, so a replay's retries stay in it.
TRACE_REPLAY_KEY: Final = "trace_replay"
# Written by the other parts; read defensively, as they may be absent.
_RETRY_DECISION_KEY: Final = "retry_decision"
_REPLAY_OF_KEY: Final = "replay_of"

# -- attribute names (semantic conventions; the semconv package is not a runtime dependency) ----

MESSAGING_SYSTEM: Final = "messaging.system"
MESSAGING_OPERATION_TYPE: Final = "messaging.operation.type"
MESSAGING_OPERATION_NAME: Final = "messaging.operation.name"
MESSAGING_DESTINATION_NAME: Final = "messaging.destination.name"
MESSAGING_MESSAGE_ID: Final = "messaging.message.id"
MESSAGING_MESSAGE_BODY_SIZE: Final = "messaging.message.body.size"
MESSAGING_BATCH_MESSAGE_COUNT: Final = "messaging.batch.message_count"
MESSAGING_RABBITMQ_ROUTING_KEY: Final = "messaging.rabbitmq.destination.routing_key"
ERROR_TYPE: Final = "error.type"
HTTP_RESPONSE_STATUS_CODE: Final = "http.response.status_code"
# Ours: Dramatiq's concepts under "dramatiq.", this package's under "dramatiq_reliable.".
DRAMATIQ_ACTOR_NAME: Final = "dramatiq.actor.name"
DRAMATIQ_MESSAGE_ATTEMPT: Final = "dramatiq.message.attempt"
DRAMATIQ_MESSAGE_DELAY_MS: Final = "dramatiq.message.delay_ms"
DRAMATIQ_MESSAGE_SKIPPED: Final = "dramatiq.message.skipped"
RETRY_OUTCOME: Final = "dramatiq_reliable.retry.outcome"
RETRY_CATEGORY: Final = "dramatiq_reliable.retry.category"
RETRY_REASON: Final = "dramatiq_reliable.retry.reason"
RETRY_ATTEMPT: Final = "dramatiq_reliable.retry.attempt"
RETRY_DELAY_MS: Final = "dramatiq_reliable.retry.delay_ms"
DEAD_LETTERED: Final = "dramatiq_reliable.dead_lettered"
DUPLICATE: Final = "dramatiq_reliable.idempotency.duplicate"
REPLAY_COUNT: Final = "dramatiq_reliable.replay.count"
LINK_ROLE: Final = "dramatiq_reliable.link.role"
QUEUE_KIND: Final = "dramatiq_reliable.queue.kind"

_INSTRUMENTATION = "dramatiq_reliable"
# The conventions' advice for messaging durations, in seconds.
_DURATION_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
# Event fields are free text (error messages): keep span events small.
_EVENT_VALUE_MAX_CHARS = 1024
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

_W3C = TraceContextTextMapPropagator()


@dataclasses.dataclass
class _Send:
    """A producer or send span waiting for its ``after_enqueue``."""

    message_id: str
    span: Span
    started: float
    attributes: dict[str, AttributeValue]
    sent: bool


@dataclasses.dataclass
class _Attempt:
    """The processing attempt running on a worker thread."""

    message_id: str
    span: Span
    token: contextvars.Token[otel_context.Context]
    started: float
    destination: str
    attempt: int
    retries_before: int
    decision_before: Any
    metric_attributes: dict[str, AttributeValue]
    retry_delay_ms: int | None = None
    retry_event_seen: bool = False


@dataclasses.dataclass
class _Finished:
    """The attempt that just ended on this thread: events of its message emitted from the
    ack/nack hooks that follow (``DeadLetters`` stores in ``before_nack``) still belong to it."""

    message_id: str
    span_context: SpanContext
    destination: str


class _ThreadState:
    """Per-thread bookkeeping; weak-referenced from the middleware so shutdown can sweep it."""

    def __init__(self) -> None:
        self.sends: dict[str, _Send] = {}
        self.attempt: _Attempt | None = None
        self.finished: _Finished | None = None


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
        _check_ms("health_cache_ms", health_cache_ms, minimum=0, fix="10000 is the default")
        self.tracer_provider = tracer_provider
        self.meter_provider = meter_provider
        self.propagator = propagator
        self.health_metrics = health_metrics
        self.queue_depth = queue_depth
        self.health_cache_ms = health_cache_ms

        version = _version()
        # With no provider given these are proxies that follow the global provider, even one
        # set after this middleware was built.
        self._tracer = trace.get_tracer(_INSTRUMENTATION, version, tracer_provider=tracer_provider)
        meter = metrics.get_meter(_INSTRUMENTATION, version, meter_provider=meter_provider)
        self._sent = meter.create_counter(
            "messaging.client.sent.messages", unit="{message}", description="Messages published to RabbitMQ."
        )
        self._consumed = meter.create_counter(
            "messaging.client.consumed.messages",
            unit="{message}",
            description="Messages delivered to an actor (one per processing attempt).",
        )
        self._process_duration = meter.create_histogram(
            "messaging.process.duration",
            unit="s",
            description="Duration of processing one message, middleware included.",
            explicit_bucket_boundaries_advisory=_DURATION_BUCKETS,
        )
        self._operation_duration = meter.create_histogram(
            "messaging.client.operation.duration",
            unit="s",
            description="Duration of an outbox insert (create) or a publish to RabbitMQ (send).",
            explicit_bucket_boundaries_advisory=_DURATION_BUCKETS,
        )
        self._retries = meter.create_counter(
            "dramatiq_reliable.retries", unit="{retry}", description="Retries scheduled, by category and reason."
        )
        self._dead_lettered = meter.create_counter(
            "dramatiq_reliable.dead_lettered",
            unit="{message}",
            description="Messages that failed for good (dead-lettered), by error type and reason.",
        )
        self._duplicates = meter.create_counter(
            "dramatiq_reliable.duplicates_skipped",
            unit="{message}",
            description="Messages skipped by Idempotency as duplicates of one that already ran.",
        )
        if health_metrics:
            meter.create_observable_gauge(
                "dramatiq_reliable.outbox.backlog",
                callbacks=[self._observe_backlog],
                unit="{message}",
                description="Committed outbox rows not yet published, by queue.",
            )
            meter.create_observable_gauge(
                "dramatiq_reliable.outbox.oldest_age",
                callbacks=[self._observe_oldest],
                unit="s",
                description="Age of the oldest unpublished outbox row, by queue (a dead relay shows here).",
            )
            meter.create_observable_gauge(
                "dramatiq_reliable.dead_letters.pending",
                callbacks=[self._observe_dead_letters],
                unit="{message}",
                description="Dead letters neither replayed nor discarded, by queue.",
            )
            if queue_depth:
                meter.create_observable_gauge(
                    "dramatiq_reliable.queue.depth",
                    callbacks=[self._observe_depth],
                    unit="{message}",
                    description="Ready messages in RabbitMQ, by queue and kind (ready, delayed, dead).",
                )

        self._broker: Broker | None = None
        self._local = threading.local()
        self._states: weakref.WeakSet[_ThreadState] = weakref.WeakSet()
        self._states_lock = threading.Lock()
        self._monitor: HealthMonitor | None = None
        self._monitor_lock = threading.Lock()
        self._warned_order = False
        events.subscribe(self._on_event)

    def __repr__(self) -> str:
        return f"Tracing(health_metrics={self.health_metrics!r}, queue_depth={self.queue_depth!r})"

    def close(self) -> None:
        """Stop listening to events, end spans left open and close the gauges' connection."""
        events.unsubscribe(self._on_event)
        self._sweep()
        with self._monitor_lock:
            monitor, self._monitor = self._monitor, None
        if monitor is not None:
            monitor.close()

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
        self._sweep()
        self._flush()
        with self._monitor_lock:
            monitor = self._monitor
        if monitor is not None:
            monitor.close()

    # -- sending -----------------------------------------------------------------------------------

    def before_enqueue(self, broker: Broker, message: Message[Any], delay: int | None) -> None:
        self._broker = broker
        state = self._state()
        if state.sends:
            # enqueue() is not re-entrant: a leftover span is one whose enqueue raised.
            for stale in list(state.sends.values()):
                self._end_stale_send(stale)
            state.sends.clear()
        options = message.options
        destination = message.queue_name
        system = _system(broker)
        creation = self._extract(options.get(TRACE_CONTEXT_KEY))
        creation_sc = _span_context_of(creation)
        links: list[Link] = []
        attributes: dict[str, AttributeValue] = {
            MESSAGING_SYSTEM: system,
            MESSAGING_DESTINATION_NAME: destination,
            MESSAGING_MESSAGE_ID: message.message_id,
            DRAMATIQ_ACTOR_NAME: message.actor_name,
        }
        if system == "rabbitmq":
            attributes[MESSAGING_RABBITMQ_ROUTING_KEY] = destination
        if delay is not None:
            attributes[DRAMATIQ_MESSAGE_DELAY_MS] = int(delay)

        inject = False
        if isinstance(threading.current_thread(), ConsumerThread):
            # Dramatiq's consumer thread moving a due message from .DQ: a direct publish.
            operation, kind = "send", SpanKind.CLIENT
            parent: otel_context.Context | None = _hop_parent(options, creation) or otel_context.Context()
        else:
            # Into the outbox it is created, not yet sent; other brokers publish right away.
            operation = "create" if isinstance(broker, OutboxBroker) else "send"
            kind = SpanKind.PRODUCER
            parent = None  # the caller's context: the request, or the attempt that retries
            inject = creation_sc is None
            attempt = state.attempt
            if attempt is not None and attempt.message_id == message.message_id and delay is not None:
                attempt.retry_delay_ms = int(delay)
        if creation_sc is not None:
            links.append(Link(creation_sc, {LINK_ROLE: "creation"}))
        attributes[MESSAGING_OPERATION_TYPE] = operation
        attributes[MESSAGING_OPERATION_NAME] = operation
        span = self._tracer.start_span(
            f"{operation} {destination}", context=parent, kind=kind, attributes=attributes, links=links
        )
        if inject:
            carrier: dict[str, str] = {}
            self._propagator().inject(carrier, context=trace.set_span_in_context(span))
            if carrier:
                options[TRACE_CONTEXT_KEY] = carrier
        state.sends[message.message_id] = _Send(
            message_id=message.message_id,
            span=span,
            started=time.perf_counter(),
            attributes={
                MESSAGING_SYSTEM: system,
                MESSAGING_DESTINATION_NAME: destination,
                MESSAGING_OPERATION_TYPE: operation,
                MESSAGING_OPERATION_NAME: operation,
            },
            sent=operation == "send",
        )

    def after_enqueue(self, broker: Broker, message: Message[Any], delay: int | None) -> None:
        state = self._state()
        pending = state.sends.pop(message.message_id, None)
        if pending is None:
            return
        pending.span.end()
        self._operation_duration.record(time.perf_counter() - pending.started, pending.attributes)
        if pending.sent:
            self._sent.add(1, _without(pending.attributes, MESSAGING_OPERATION_TYPE))

    def after_enqueue_failed(
        self, broker: Broker, message: Message[Any], delay: int | None, *, exception: BaseException
    ) -> None:
        """Called by ``OutboxBroker`` when the outbox insert raised: close the span as an error."""
        pending = self._state().sends.pop(message.message_id, None)
        if pending is None:
            return
        pending.span.record_exception(exception)
        pending.span.set_status(Status(StatusCode.ERROR, f"{type(exception).__name__}: {exception}"))
        pending.span.set_attribute(ERROR_TYPE, _type_name(type(exception)))
        pending.span.end()
        self._operation_duration.record(
            time.perf_counter() - pending.started,
            {**pending.attributes, ERROR_TYPE: _type_name(type(exception))},
        )

    # -- processing --------------------------------------------------------------------------------

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        self._broker = broker
        state = self._state()
        if state.attempt is not None:
            # Only possible if our after-hook never ran for the last message; never let it leak.
            self._finish(state, state.attempt, stale=True)
        state.finished = None
        options = message.options
        destination = message.queue_name
        system = _system(broker)
        creation = self._extract(options.get(TRACE_CONTEXT_KEY))
        creation_sc = _span_context_of(creation)
        previous_sc = _span_context_of(_W3C.extract(_carrier(options.get(PREVIOUS_ATTEMPT_KEY))))
        retries_before = _int(options.get("retries"))
        links: list[Link] = []
        attributes: dict[str, AttributeValue] = {
            MESSAGING_SYSTEM: system,
            MESSAGING_OPERATION_TYPE: "process",
            MESSAGING_OPERATION_NAME: "process",
            MESSAGING_DESTINATION_NAME: destination,
            MESSAGING_MESSAGE_ID: message.message_id,
            DRAMATIQ_ACTOR_NAME: message.actor_name,
            DRAMATIQ_MESSAGE_ATTEMPT: retries_before + 1,
        }
        if system == "rabbitmq":
            attributes[MESSAGING_RABBITMQ_ROUTING_KEY] = destination

        parent: otel_context.Context = creation if creation is not None else otel_context.Context()
        replay = _replay_count(options)
        new_replay = replay is not None and options.get(TRACE_REPLAY_KEY) != replay
        if new_replay:
            # A replay is a new operation: a trace of its own, linked to the one that died.
            assert replay is not None
            attributes[REPLAY_COUNT] = replay
            if creation_sc is not None:
                links.append(Link(creation_sc, {LINK_ROLE: "origin"}))
            parent = otel_context.Context()
        elif creation_sc is not None:
            links.append(Link(creation_sc, {LINK_ROLE: "creation"}))
        origin_sc = _span_context_of(self._extract(options.get(TRACE_ORIGIN_KEY)))
        if origin_sc is not None and not new_replay:
            links.append(Link(origin_sc, {LINK_ROLE: "origin"}))
        if previous_sc is not None:
            links.append(Link(previous_sc, {LINK_ROLE: "previous_attempt"}))

        span = self._tracer.start_span(
            f"process {destination}", context=parent, kind=SpanKind.CONSUMER, attributes=attributes, links=links
        )
        span_context = span.get_span_context()
        token = otel_context.attach(trace.set_span_in_context(span, parent))
        # From here on the attempt is registered, so the after-hooks always detach the token.
        metric_attributes: dict[str, AttributeValue] = {
            MESSAGING_SYSTEM: system,
            MESSAGING_DESTINATION_NAME: destination,
            MESSAGING_OPERATION_NAME: "process",
        }
        state.attempt = _Attempt(
            message_id=message.message_id,
            span=span,
            token=token,
            started=time.perf_counter(),
            destination=destination,
            attempt=retries_before + 1,
            retries_before=retries_before,
            decision_before=options.get(_RETRY_DECISION_KEY),
            metric_attributes=metric_attributes,
        )
        try:
            if span_context.is_valid:
                if new_replay:
                    if options.get(TRACE_CONTEXT_KEY) is not None:
                        options[TRACE_ORIGIN_KEY] = options[TRACE_CONTEXT_KEY]
                    options[TRACE_REPLAY_KEY] = replay
                if creation_sc is None or new_replay:
                    # No creation context (an uninstrumented producer) or a replay: this attempt
                    # becomes it, so the retries that follow join its trace.
                    carrier: dict[str, str] = {}
                    self._propagator().inject(carrier)
                    options[TRACE_CONTEXT_KEY] = carrier
                previous: dict[str, str] = {}
                _W3C.inject(previous)
                options[PREVIOUS_ATTEMPT_KEY] = previous
        finally:
            self._consumed.add(1, metric_attributes)

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any | None = None,
        exception: BaseException | None = None,
    ) -> None:
        state = self._state()
        attempt = state.attempt
        if attempt is None:
            return
        error_type: str | None = None
        try:
            error_type = self._record_outcome(attempt, message, exception)
        except Exception:
            logger.exception("could not record the outcome of message %s on its span", attempt.message_id)
        finally:
            self._finish(state, attempt, error_type=error_type)

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        state = self._state()
        attempt = state.attempt
        if attempt is None:
            return
        error_type: str | None = None
        try:
            attempt.span.set_attribute(DRAMATIQ_MESSAGE_SKIPPED, True)
            if message.failed:
                # Dramatiq keeps the SkipMessage that failed it (IdempotencyConflict, say) on the proxy.
                reason = getattr(message, "_exception", None)
                error_type = _type_name(type(reason)) if isinstance(reason, BaseException) else "_OTHER"
                if isinstance(reason, BaseException):
                    attempt.span.record_exception(reason)
                attempt.span.set_status(Status(StatusCode.ERROR, error_type))
                attempt.span.set_attribute(ERROR_TYPE, error_type)
                self._mark_dead_lettered(attempt, message, error_type, None)
        except Exception:
            logger.exception("could not record the skip of message %s on its span", attempt.message_id)
        finally:
            self._finish(state, attempt, error_type=error_type)

    def _record_outcome(self, attempt: _Attempt, message: MessageProxy, exception: BaseException | None) -> str | None:
        span = attempt.span
        options = message.options
        error_type: str | None = None
        if exception is not None:
            error_type = _type_name(type(exception))
            span.record_exception(exception)
            span.set_status(Status(StatusCode.ERROR, error_type))
            span.set_attribute(ERROR_TYPE, error_type)

        decision = options.get(_RETRY_DECISION_KEY)
        if decision is attempt.decision_before or not isinstance(decision, Mapping):
            decision = None  # left over from an earlier attempt, or no ClassifiedRetries
        if decision is None and exception is not None:
            decision = _inferred_decision(attempt, message)
        if decision is not None:
            self._record_decision(attempt, decision)
        if message.failed:
            if error_type is None:
                error_type = "_OTHER"
                span.set_status(Status(StatusCode.ERROR, "failed by a middleware"))
                span.set_attribute(ERROR_TYPE, error_type)
            self._mark_dead_lettered(attempt, message, error_type, decision)
        return error_type

    def _record_decision(self, attempt: _Attempt, decision: Mapping[str, Any]) -> None:
        retry = bool(decision.get("retry"))
        outcome = decision.get("outcome") or ("retry" if retry else "fail")
        delay_ms = decision.get("delay_ms")
        if delay_ms is None and retry:
            delay_ms = attempt.retry_delay_ms
        values: dict[str, AttributeValue] = {RETRY_OUTCOME: str(outcome)}
        for key, name in (("category", RETRY_CATEGORY), ("reason", RETRY_REASON)):
            if isinstance(decision.get(key), str):
                values[name] = decision[key]
        values[RETRY_ATTEMPT] = _int(decision.get("attempt"), attempt.attempt)
        if isinstance(delay_ms, int) and not isinstance(delay_ms, bool):
            values[RETRY_DELAY_MS] = delay_ms
        status = decision.get("http_status")
        if isinstance(status, int) and not isinstance(status, bool):
            values[HTTP_RESPONSE_STATUS_CODE] = status
        attempt.span.set_attributes(values)
        if not attempt.retry_event_seen:
            # No ClassifiedRetries event reached this span: say it ourselves, same names.
            attempt.span.add_event("retry.scheduled" if retry else "retry.gave_up", values)
        if retry:
            self._retries.add(
                1,
                {
                    MESSAGING_DESTINATION_NAME: attempt.destination,
                    RETRY_CATEGORY: str(decision.get("category") or "unknown"),
                    RETRY_REASON: str(decision.get("reason") or "unknown"),
                },
            )

    def _mark_dead_lettered(
        self, attempt: _Attempt, message: MessageProxy, error_type: str, decision: Mapping[str, Any] | None
    ) -> None:
        reason = str((decision or {}).get("reason") or "unknown")
        attempt.span.set_attribute(DEAD_LETTERED, True)
        attempt.span.add_event("dead_lettered", {ERROR_TYPE: error_type, RETRY_REASON: reason})
        self._dead_lettered.add(
            1, {MESSAGING_DESTINATION_NAME: attempt.destination, ERROR_TYPE: error_type, RETRY_REASON: reason}
        )

    def _finish(
        self, state: _ThreadState, attempt: _Attempt, *, error_type: str | None = None, stale: bool = False
    ) -> None:
        """Detach, end and forget the attempt: whatever happens, the thread's context is restored."""
        state.attempt = None
        try:
            otel_context.detach(attempt.token)
        except Exception:  # pragma: no cover - detach logs and swallows its own errors
            logger.debug("could not detach the context of message %s", attempt.message_id, exc_info=True)
        try:
            if stale:
                attempt.span.set_status(Status(StatusCode.ERROR, "processing did not finish"))
            attempt.span.end()
        finally:
            state.finished = _Finished(attempt.message_id, attempt.span.get_span_context(), attempt.destination)
            attributes = dict(attempt.metric_attributes)
            if error_type is not None:
                attributes[ERROR_TYPE] = error_type
            self._process_duration.record(time.perf_counter() - attempt.started, attributes)

    # -- events ------------------------------------------------------------------------------------

    def _on_event(self, event: events.Event) -> None:
        name = str(getattr(event, "name", "") or "event")
        if name == "outbox.batch_published":
            self._on_batch_published(event)
            return
        attributes = _event_attributes(event)
        message_id = attributes.get("message_id")
        state = self._state()
        attempt = state.attempt
        destination: str | None = None
        if attempt is not None and (message_id is None or message_id == attempt.message_id):
            attempt.span.add_event(name, attributes)
            destination = attempt.destination
            if name.startswith("retry."):
                attempt.retry_event_seen = True
            elif name == "idempotency.duplicate":
                attempt.span.set_attribute(DUPLICATE, True)
        elif state.finished is not None and message_id == state.finished.message_id:
            # Emitted from the ack/nack hooks, after the attempt's span ended: a short child.
            finished = state.finished
            destination = finished.destination
            span = self._tracer.start_span(
                name,
                context=trace.set_span_in_context(trace.NonRecordingSpan(finished.span_context)),
                kind=SpanKind.INTERNAL,
                attributes={MESSAGING_MESSAGE_ID: finished.message_id, MESSAGING_DESTINATION_NAME: destination},
            )
            span.add_event(name, attributes)
            span.end()
        if name == "idempotency.duplicate":
            queue = destination or attributes.get("queue_name")
            self._duplicates.add(1, {MESSAGING_DESTINATION_NAME: str(queue)} if queue else {})

    def _on_batch_published(self, event: Any) -> None:
        """One ``send`` span per message of a relay batch, in the message's trace."""
        messages = tuple(getattr(event, "messages", ()) or ())
        if not messages:
            return
        start_ns = _int(getattr(event, "start_time_ns", None), time.time_ns())
        end_ns = max(start_ns, _int(getattr(event, "end_time_ns", None), time.time_ns()))
        destinations: set[str] = set()
        for item in messages:
            queue_name = str(getattr(item, "queue_name", "") or "")
            message_id = str(getattr(item, "message_id", "") or "")
            body = getattr(item, "body", b"")
            error = getattr(item, "error", None)
            destinations.add(queue_name)
            options = _options_of(body)
            creation = self._extract(options.get(TRACE_CONTEXT_KEY))
            creation_sc = _span_context_of(creation)
            attributes: dict[str, AttributeValue] = {
                MESSAGING_SYSTEM: "rabbitmq",
                MESSAGING_OPERATION_TYPE: "send",
                MESSAGING_OPERATION_NAME: "send",
                MESSAGING_DESTINATION_NAME: queue_name,
                MESSAGING_RABBITMQ_ROUTING_KEY: queue_name,
                MESSAGING_MESSAGE_ID: message_id,
                MESSAGING_MESSAGE_BODY_SIZE: len(body) if isinstance(body, (bytes, bytearray, memoryview)) else 0,
            }
            if len(messages) > 1:
                attributes[MESSAGING_BATCH_MESSAGE_COUNT] = len(messages)
            replay = _replay_count(options)
            if replay is not None and options.get(TRACE_REPLAY_KEY) != replay:
                attributes[REPLAY_COUNT] = replay
                parent = creation  # the replay goes out in the trace of the job that died
            else:
                parent = _hop_parent(options, creation)
            links = [Link(creation_sc, {LINK_ROLE: "creation"})] if creation_sc is not None else []
            span = self._tracer.start_span(
                f"send {queue_name}",
                context=parent or otel_context.Context(),
                kind=SpanKind.CLIENT,
                attributes=attributes,
                links=links,
                start_time=start_ns,
            )
            metric_attributes: dict[str, AttributeValue] = {
                MESSAGING_SYSTEM: "rabbitmq",
                MESSAGING_DESTINATION_NAME: queue_name,
                MESSAGING_OPERATION_NAME: "send",
            }
            if error is not None:
                error_type = _publish_error_type(str(error))
                span.set_status(Status(StatusCode.ERROR, str(error)[:_EVENT_VALUE_MAX_CHARS]))
                span.set_attribute(ERROR_TYPE, error_type)
                metric_attributes[ERROR_TYPE] = error_type
            span.end(end_time=end_ns)
            self._sent.add(1, metric_attributes)
        duration_attributes: dict[str, AttributeValue] = {
            MESSAGING_SYSTEM: "rabbitmq",
            MESSAGING_OPERATION_TYPE: "send",
            MESSAGING_OPERATION_NAME: "send",
        }
        if len(destinations) == 1:
            duration_attributes[MESSAGING_DESTINATION_NAME] = destinations.pop()
        self._operation_duration.record((end_ns - start_ns) / 1e9, duration_attributes)

    # -- gauges ------------------------------------------------------------------------------------

    def _health(self) -> Health | None:
        broker = self._broker
        if broker is None:
            return None
        with self._monitor_lock:
            if self._monitor is None:
                self._monitor = self._build_monitor(broker)
            monitor = self._monitor
        return monitor.get() if monitor is not None else None

    def _build_monitor(self, broker: Broker) -> HealthMonitor | None:
        database = broker.database if isinstance(broker, OutboxBroker) else None
        schema_name = broker.schema if isinstance(broker, OutboxBroker) else None
        depths = None
        if self.queue_depth and isinstance(broker, RabbitmqBroker):
            depths = QueueDepths(parameters=broker.parameters)
        if database is None and depths is None:
            return None

        def queues() -> Iterable[str]:
            return sorted(broker.get_declared_queues())

        return HealthMonitor(
            database=database,
            schema=schema_name or "dramatiq_reliable",
            rabbitmq=depths,
            queues=queues,
            ttl_ms=self.health_cache_ms,
        )

    def _observe_postgres(self, read: Callable[[QueueHealth], float | int | None]) -> list[Observation]:
        """One observation per queue of a number read from Postgres (none while it is unreachable)."""
        health = self._health()
        if health is None or health.postgres_error:
            return []
        return [
            Observation(value, {MESSAGING_DESTINATION_NAME: item.queue})
            for item in health.queues
            if (value := read(item)) is not None
        ]

    def _observe_backlog(self, options: CallbackOptions) -> Iterable[Observation]:
        return self._observe_postgres(lambda item: item.outbox_backlog)

    def _observe_oldest(self, options: CallbackOptions) -> Iterable[Observation]:
        return self._observe_postgres(
            lambda item: None if item.outbox_backlog is None else (item.outbox_oldest_age_s or 0.0)
        )

    def _observe_dead_letters(self, options: CallbackOptions) -> Iterable[Observation]:
        return self._observe_postgres(lambda item: item.dead_letters)

    def _observe_depth(self, options: CallbackOptions) -> Iterable[Observation]:
        health = self._health()
        if health is None or health.rabbitmq_error:
            return []
        observations = []
        for item in health.queues:
            for kind, value in (("ready", item.depth), ("delayed", item.delayed), ("dead", item.dead)):
                if value is not None:
                    observations.append(Observation(value, {MESSAGING_DESTINATION_NAME: item.queue, QUEUE_KIND: kind}))
        return observations

    # -- helpers -----------------------------------------------------------------------------------

    def _state(self) -> _ThreadState:
        state: _ThreadState | None = getattr(self._local, "state", None)
        if state is None:
            state = self._local.state = _ThreadState()
            with self._states_lock:
                self._states.add(state)
        return state

    def _propagator(self) -> TextMapPropagator:
        return self.propagator if self.propagator is not None else propagate.get_global_textmap()

    def _extract(self, carrier: object) -> otel_context.Context | None:
        values = _carrier(carrier)
        if not values:
            return None
        ctx = self._propagator().extract(values, context=otel_context.Context())
        return ctx if _span_context_of(ctx) is not None else None

    def _end_stale_send(self, stale: _Send) -> None:
        stale.span.set_status(Status(StatusCode.ERROR, "enqueue did not complete"))
        stale.span.set_attribute(ERROR_TYPE, "_OTHER")
        stale.span.end()

    def _sweep(self) -> None:
        """End spans left open in any thread (enqueues that raised); attempts are left to their thread."""
        with self._states_lock:
            states = list(self._states)
        for state in states:
            for stale in list(state.sends.values()):
                self._end_stale_send(stale)
            state.sends.clear()

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
        with self._states_lock:
            states = list(self._states)
        return sum(len(state.sends) + (state.attempt is not None) for state in states)


# -- module helpers ----------------------------------------------------------------------------------


def _version() -> str:
    try:
        return importlib.metadata.version("dramatiq-reliable")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - running from a checkout
        return "0"


def _system(broker: Broker) -> str:
    return "rabbitmq" if isinstance(broker, RabbitmqBroker) else "dramatiq"


def _carrier(value: object) -> dict[str, str]:
    if not isinstance(value, Mapping):
        return {}
    return {str(key): str(item) for key, item in value.items() if isinstance(item, str)}


def _span_context_of(ctx: otel_context.Context | None) -> SpanContext | None:
    if ctx is None:
        return None
    span_context = trace.get_current_span(ctx).get_span_context()
    return span_context if span_context.is_valid else None


def _hop_parent(options: Mapping[str, Any], creation: otel_context.Context | None) -> otel_context.Context | None:
    """The parent of a publish of an existing message: the attempt that scheduled it, if any.

    A retry is published (by the relay, then the delay-queue hop) because an attempt failed;
    under that attempt the trace reads in order.  Only within one trace: a replay's previous
    attempt belongs to the trace that died.
    """
    previous = _span_context_of(_W3C.extract(_carrier(options.get(PREVIOUS_ATTEMPT_KEY))))
    creation_sc = _span_context_of(creation)
    if previous is not None and (creation_sc is None or previous.trace_id == creation_sc.trace_id):
        return trace.set_span_in_context(trace.NonRecordingSpan(previous), otel_context.Context())
    return creation


def _replay_count(options: Mapping[str, Any]) -> int | None:
    """Which replay of a dead letter this message is (``replay_of["count"]``), or ``None``."""
    replay = options.get(_REPLAY_OF_KEY)
    if isinstance(replay, Mapping):
        return _int(replay.get("count"), 1)
    if replay is not None:
        return 1
    return None


def _options_of(body: object) -> Mapping[str, Any]:
    if not isinstance(body, (bytes, bytearray, memoryview)):
        return {}
    try:
        options = Message.decode(bytes(body)).options
    except (DecodeError, TypeError, ValueError, AttributeError):
        return {}
    return options if isinstance(options, Mapping) else {}


def _inferred_decision(attempt: _Attempt, message: MessageProxy) -> dict[str, Any] | None:
    """What Dramatiq's own ``Retries`` did, read from its traces on the message."""
    if message.failed:
        return {"retry": False, "outcome": "fail", "attempt": attempt.attempt}
    if _int(message.options.get("retries")) > attempt.retries_before or attempt.retry_delay_ms is not None:
        return {"retry": True, "outcome": "retry", "attempt": attempt.attempt, "delay_ms": attempt.retry_delay_ms}
    return None  # no retry middleware: the message is acked and the failure is on the span only


def _int(value: object, default: int = 0) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _publish_error_type(error: str) -> str:
    text = error.lower()
    if text.startswith("unroutable"):
        return "unroutable"
    if "nack" in text:
        return "nacked"
    return "_OTHER"


def _without(attributes: Mapping[str, AttributeValue], *names: str) -> dict[str, AttributeValue]:
    return {key: value for key, value in attributes.items() if key not in names}


def _event_attributes(event: object) -> dict[str, AttributeValue]:
    """An event's fields as span-event attributes: scalars kept, anything else as short text."""
    as_attributes = getattr(event, "as_attributes", None)
    raw = as_attributes() if callable(as_attributes) else {}
    attributes: dict[str, AttributeValue] = {}
    for key, value in (raw or {}).items():
        if value is None:
            continue
        if isinstance(value, (bool, int, float)):
            attributes[str(key)] = value
        elif isinstance(value, str):
            attributes[str(key)] = value[:_EVENT_VALUE_MAX_CHARS]
        elif isinstance(value, Sequence) and all(isinstance(item, str) for item in value):
            attributes[str(key)] = tuple(str(item)[:_EVENT_VALUE_MAX_CHARS] for item in value)
        else:
            attributes[str(key)] = str(value)[:_EVENT_VALUE_MAX_CHARS]
    return attributes
