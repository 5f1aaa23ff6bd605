"""Spans of one job: the producer span of each enqueue and the consumer span of each processing attempt.

:class:`SpanRecorder` does the work of the middleware's enqueue and process hooks.  It keeps
its state per thread (enqueue and processing both happen on the calling thread, and a worker
thread runs one message at a time), weak-referenced so a shutdown can end what an enqueue
that raised left open.

* ``create <queue>`` (PRODUCER): an enqueue into the outbox; ``send <queue>`` (PRODUCER) on a
  broker that publishes at once.  Its context becomes the message's creation context when the
  message has none yet (:mod:`.propagation`).
* ``send <queue>`` (CLIENT): Dramatiq's consumer thread moving a due message out of ``.DQ``.
* ``process <queue>`` (CONSUMER): one attempt, child of the creation context, linked to it and
  to the previous attempt, carrying the retry decision, dead-lettering and skips.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any

from dramatiq.broker import Broker, MessageProxy
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.message import Message
from dramatiq.worker import ConsumerThread
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, Span, SpanContext, SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue

from .._checks import is_int
from .._util import type_name
from ..backing import postgres_backed
from . import propagation
from . import semconv as names
from .metrics import Instruments
from .propagation import RETRY_DECISION_KEY, TRACE_CONTEXT_KEY, TRACE_ORIGIN_KEY, TRACE_REPLAY_KEY, Propagation

__all__ = []

logger = logging.getLogger("dramatiq_reliable.tracing")


@dataclasses.dataclass
class Send:
    """A producer or send span waiting for its ``after_enqueue``."""

    message_id: str
    span: Span
    started: float
    attributes: dict[str, AttributeValue]
    sent: bool


@dataclasses.dataclass
class Attempt:
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
class Finished:
    """The attempt that just ended on this thread: events of its message emitted from the
    ack/nack hooks that follow (``DeadLetters`` stores in ``before_nack``) still belong to it."""

    message_id: str
    span_context: SpanContext
    destination: str


class ThreadState:
    """Per-thread bookkeeping; weak-referenced from the recorder so shutdown can sweep it."""

    def __init__(self) -> None:
        self.sends: dict[str, Send] = {}
        self.attempt: Attempt | None = None
        self.finished: Finished | None = None


class SpanRecorder:
    """Starts and ends the enqueue and processing spans, and records their metrics."""

    def __init__(self, tracer: trace.Tracer, propagation: Propagation, instruments: Instruments) -> None:
        self._tracer = tracer
        self._propagation = propagation
        self._instruments = instruments
        self._local = threading.local()
        self._states: weakref.WeakSet[ThreadState] = weakref.WeakSet()
        self._states_lock = threading.Lock()

    # -- per-thread state ------------------------------------------------------------------------

    def state(self) -> ThreadState:
        """This thread's state, created on first use."""
        state: ThreadState | None = getattr(self._local, "state", None)
        if state is None:
            state = self._local.state = ThreadState()
            with self._states_lock:
                self._states.add(state)
        return state

    def current(self) -> ThreadState | None:
        """This thread's state if it has any (an event from a thread that never traced creates none)."""
        state: ThreadState | None = getattr(self._local, "state", None)
        return state

    def sweep(self) -> None:
        """End spans left open in any thread (enqueues that raised); attempts are left to their thread."""
        with self._states_lock:
            states = list(self._states)
        for state in states:
            for stale in list(state.sends.values()):
                _end_stale_send(stale)
            state.sends.clear()

    def open_spans(self) -> int:
        """Spans held open across all threads (for tests: 0 when idle)."""
        with self._states_lock:
            states = list(self._states)
        return sum(len(state.sends) + (state.attempt is not None) for state in states)

    # -- sending ---------------------------------------------------------------------------------

    def start_send(self, broker: Broker, message: Message[Any], delay: int | None) -> None:
        """Open the span of an enqueue, and write the creation context if the message has none."""
        state = self.state()
        if state.sends:
            # enqueue() is not re-entrant: a leftover span is one whose enqueue raised.
            for stale in list(state.sends.values()):
                _end_stale_send(stale)
            state.sends.clear()
        options = message.options
        destination = message.queue_name
        system = _system(broker)
        creation = self._propagation.extract(options.get(TRACE_CONTEXT_KEY))
        creation_sc = propagation.span_context_of(creation)
        links: list[Link] = []
        attributes: dict[str, AttributeValue] = {
            names.MESSAGING_SYSTEM: system,
            names.MESSAGING_DESTINATION_NAME: destination,
            names.MESSAGING_MESSAGE_ID: message.message_id,
            names.DRAMATIQ_ACTOR_NAME: message.actor_name,
        }
        if system == names.SYSTEM_RABBITMQ:
            attributes[names.MESSAGING_RABBITMQ_ROUTING_KEY] = destination
        if delay is not None:
            attributes[names.DRAMATIQ_MESSAGE_DELAY_MS] = int(delay)

        inject = False
        if isinstance(threading.current_thread(), ConsumerThread):
            # Dramatiq's consumer thread moving a due message from .DQ: a direct publish.
            operation, kind = names.OPERATION_SEND, SpanKind.CLIENT
            parent: otel_context.Context | None = propagation.hop_parent(options, creation) or otel_context.Context()
        else:
            # Into the outbox it is created, not yet sent; other brokers publish right away.
            backed = postgres_backed(broker)
            operation = (
                names.OPERATION_CREATE if backed is not None and backed.sends_to == "outbox" else names.OPERATION_SEND
            )
            kind = SpanKind.PRODUCER
            parent = None  # the caller's context: the request, or the attempt that retries
            inject = creation_sc is None
            attempt = state.attempt
            if attempt is not None and attempt.message_id == message.message_id and delay is not None:
                attempt.retry_delay_ms = int(delay)
        if creation_sc is not None:
            links.append(Link(creation_sc, {names.LINK_ROLE: names.LINK_ROLE_CREATION}))
        attributes[names.MESSAGING_OPERATION_TYPE] = operation
        attributes[names.MESSAGING_OPERATION_NAME] = operation
        span = self._tracer.start_span(
            names.span_name(operation, destination), context=parent, kind=kind, attributes=attributes, links=links
        )
        if inject:
            carrier = self._propagation.inject(trace.set_span_in_context(span))
            if carrier:
                options[TRACE_CONTEXT_KEY] = carrier
        state.sends[message.message_id] = Send(
            message_id=message.message_id,
            span=span,
            started=time.perf_counter(),
            attributes={
                names.MESSAGING_SYSTEM: system,
                names.MESSAGING_DESTINATION_NAME: destination,
                names.MESSAGING_OPERATION_TYPE: operation,
                names.MESSAGING_OPERATION_NAME: operation,
            },
            sent=operation == names.OPERATION_SEND,
        )

    def end_send(self, message: Message[Any]) -> None:
        """Close the span of an enqueue that completed."""
        pending = self.state().sends.pop(message.message_id, None)
        if pending is None:
            return
        pending.span.end()
        self._instruments.operation_duration.record(time.perf_counter() - pending.started, pending.attributes)
        if pending.sent:
            sent = {key: value for key, value in pending.attributes.items() if key != names.MESSAGING_OPERATION_TYPE}
            self._instruments.sent.add(1, sent)

    def fail_send(self, message: Message[Any], exception: BaseException) -> None:
        """Close the span of an enqueue whose outbox insert raised, as an error."""
        pending = self.state().sends.pop(message.message_id, None)
        if pending is None:
            return
        error_type = type_name(type(exception))
        pending.span.record_exception(exception)
        pending.span.set_status(Status(StatusCode.ERROR, f"{type(exception).__name__}: {exception}"))
        pending.span.set_attribute(names.ERROR_TYPE, error_type)
        pending.span.end()
        self._instruments.operation_duration.record(
            time.perf_counter() - pending.started, {**pending.attributes, names.ERROR_TYPE: error_type}
        )

    # -- processing ------------------------------------------------------------------------------

    def skip_untraced(self) -> None:
        """A message processed with nothing to record: forget what the thread held before."""
        state = self.current()
        if state is None:
            return
        if state.attempt is not None:
            self._finish(state, state.attempt, stale=True)
        state.finished = None

    def start_attempt(self, broker: Broker, message: MessageProxy) -> None:
        """Open the attempt's span and attach it to this thread until :meth:`end_attempt`."""
        state = self.state()
        if state.attempt is not None:
            # Only possible if our after-hook never ran for the last message; never let it leak.
            self._finish(state, state.attempt, stale=True)
        state.finished = None
        options = message.options
        destination = message.queue_name
        system = _system(broker)
        creation = self._propagation.extract(options.get(TRACE_CONTEXT_KEY))
        creation_sc = propagation.span_context_of(creation)
        previous_sc = propagation.previous_attempt(options)
        retries_before = propagation.int_or(options.get("retries"))
        links: list[Link] = []
        attributes: dict[str, AttributeValue] = {
            names.MESSAGING_SYSTEM: system,
            names.MESSAGING_OPERATION_TYPE: names.OPERATION_PROCESS,
            names.MESSAGING_OPERATION_NAME: names.OPERATION_PROCESS,
            names.MESSAGING_DESTINATION_NAME: destination,
            names.MESSAGING_MESSAGE_ID: message.message_id,
            names.DRAMATIQ_ACTOR_NAME: message.actor_name,
            names.DRAMATIQ_MESSAGE_ATTEMPT: retries_before + 1,
        }
        if system == names.SYSTEM_RABBITMQ:
            attributes[names.MESSAGING_RABBITMQ_ROUTING_KEY] = destination

        parent: otel_context.Context = creation if creation is not None else otel_context.Context()
        replay = propagation.new_replay(options)
        if replay is not None:
            # A replay is a new operation: a trace of its own, linked to the one that died.
            attributes[names.REPLAY_COUNT] = replay
            if creation_sc is not None:
                links.append(Link(creation_sc, {names.LINK_ROLE: names.LINK_ROLE_ORIGIN}))
            parent = otel_context.Context()
        else:
            if creation_sc is not None:
                links.append(Link(creation_sc, {names.LINK_ROLE: names.LINK_ROLE_CREATION}))
            origin_sc = propagation.span_context_of(self._propagation.extract(options.get(TRACE_ORIGIN_KEY)))
            if origin_sc is not None:
                links.append(Link(origin_sc, {names.LINK_ROLE: names.LINK_ROLE_ORIGIN}))
        if previous_sc is not None:
            links.append(Link(previous_sc, {names.LINK_ROLE: names.LINK_ROLE_PREVIOUS_ATTEMPT}))
        links.extend(
            Link(child, {names.LINK_ROLE: names.LINK_ROLE_WORKFLOW_CHILD})
            for child in propagation.workflow_children(options)
        )

        span = self._tracer.start_span(
            names.span_name(names.OPERATION_PROCESS, destination),
            context=parent,
            kind=SpanKind.CONSUMER,
            attributes=attributes,
            links=links,
        )
        span_context = span.get_span_context()
        token = otel_context.attach(trace.set_span_in_context(span, parent))
        # From here on the attempt is registered, so the after-hooks always detach the token.
        metric_attributes: dict[str, AttributeValue] = {
            names.MESSAGING_SYSTEM: system,
            names.MESSAGING_DESTINATION_NAME: destination,
            names.MESSAGING_OPERATION_NAME: names.OPERATION_PROCESS,
        }
        state.attempt = Attempt(
            message_id=message.message_id,
            span=span,
            token=token,
            started=time.perf_counter(),
            destination=destination,
            attempt=retries_before + 1,
            retries_before=retries_before,
            decision_before=options.get(RETRY_DECISION_KEY),
            metric_attributes=metric_attributes,
        )
        try:
            # No valid span (no SDK): write nothing, so an uninstrumented fleet sees no new options.
            if span_context.is_valid:
                if replay is not None:
                    if options.get(TRACE_CONTEXT_KEY) is not None:
                        options[TRACE_ORIGIN_KEY] = options[TRACE_CONTEXT_KEY]
                    options[TRACE_REPLAY_KEY] = replay
                if creation_sc is None or replay is not None:
                    # No creation context (an uninstrumented producer) or a replay: this attempt
                    # becomes it, so the retries that follow join its trace.
                    options[TRACE_CONTEXT_KEY] = self._propagation.inject()
                propagation.record_attempt(options)
        finally:
            self._instruments.consumed.add(1, metric_attributes)

    def end_attempt(self, message: MessageProxy, exception: BaseException | None) -> None:
        """Record the attempt's outcome, then detach and end its span (whatever the recording did)."""
        state = self.state()
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

    def skip_attempt(self, message: MessageProxy) -> None:
        """End the attempt of a message a middleware skipped (an error only if it also failed it)."""
        state = self.state()
        attempt = state.attempt
        if attempt is None:
            return
        error_type: str | None = None
        try:
            attempt.span.set_attribute(names.DRAMATIQ_MESSAGE_SKIPPED, True)
            if message.failed:
                # Dramatiq keeps the SkipMessage that failed it (IdempotencyConflict, say) on the proxy.
                reason = getattr(message, "_exception", None)
                error_type = type_name(type(reason)) if isinstance(reason, BaseException) else names.ERROR_TYPE_OTHER
                if isinstance(reason, BaseException):
                    attempt.span.record_exception(reason)
                attempt.span.set_status(Status(StatusCode.ERROR, error_type))
                attempt.span.set_attribute(names.ERROR_TYPE, error_type)
                self._mark_dead_lettered(attempt, error_type, None)
        except Exception:
            logger.exception("could not record the skip of message %s on its span", attempt.message_id)
        finally:
            self._finish(state, attempt, error_type=error_type)

    def _record_outcome(self, attempt: Attempt, message: MessageProxy, exception: BaseException | None) -> str | None:
        span = attempt.span
        error_type: str | None = None
        if exception is not None:
            error_type = type_name(type(exception))
            span.record_exception(exception)
            span.set_status(Status(StatusCode.ERROR, error_type))
            span.set_attribute(names.ERROR_TYPE, error_type)

        decision = message.options.get(RETRY_DECISION_KEY)
        if decision is attempt.decision_before or not isinstance(decision, Mapping):
            decision = None  # left over from an earlier attempt, or no ClassifiedRetries
        if decision is None and exception is not None:
            decision = _inferred_decision(attempt, message)
        if decision is not None:
            self._record_decision(attempt, decision)
        if message.failed:
            if error_type is None:
                error_type = names.ERROR_TYPE_OTHER
                span.set_status(Status(StatusCode.ERROR, "failed by a middleware"))
                span.set_attribute(names.ERROR_TYPE, error_type)
            self._mark_dead_lettered(attempt, error_type, decision)
        return error_type

    def _record_decision(self, attempt: Attempt, decision: Mapping[str, Any]) -> None:
        retry = bool(decision.get("retry"))
        if attempt.span.is_recording():
            values = _decision_attributes(attempt, decision, retry)
            attempt.span.set_attributes(values)
            if not attempt.retry_event_seen:
                # No ClassifiedRetries event reached this span: say it ourselves, same names.
                attempt.span.add_event(names.RETRY_SCHEDULED_EVENT if retry else names.RETRY_GAVE_UP_EVENT, values)
        if retry:
            self._instruments.retries.add(
                1,
                {
                    names.MESSAGING_DESTINATION_NAME: attempt.destination,
                    names.RETRY_CATEGORY: str(decision.get("category") or "unknown"),
                    names.RETRY_REASON: str(decision.get("reason") or "unknown"),
                },
            )

    def _mark_dead_lettered(self, attempt: Attempt, error_type: str, decision: Mapping[str, Any] | None) -> None:
        reason = str((decision or {}).get("reason") or "unknown")
        attempt.span.set_attribute(names.DEAD_LETTERED, True)
        attempt.span.add_event(names.DEAD_LETTERED_EVENT, {names.ERROR_TYPE: error_type, names.RETRY_REASON: reason})
        self._instruments.dead_lettered.add(
            1,
            {
                names.MESSAGING_DESTINATION_NAME: attempt.destination,
                names.ERROR_TYPE: error_type,
                names.RETRY_REASON: reason,
            },
        )

    def _finish(
        self, state: ThreadState, attempt: Attempt, *, error_type: str | None = None, stale: bool = False
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
            state.finished = Finished(attempt.message_id, attempt.span.get_span_context(), attempt.destination)
            attributes = attempt.metric_attributes
            if error_type is not None:
                attributes = {**attributes, names.ERROR_TYPE: error_type}
            self._instruments.process_duration.record(time.perf_counter() - attempt.started, attributes)


def _system(broker: Broker) -> str:
    return names.SYSTEM_RABBITMQ if isinstance(broker, RabbitmqBroker) else names.SYSTEM_DRAMATIQ


def _end_stale_send(stale: Send) -> None:
    stale.span.set_status(Status(StatusCode.ERROR, "enqueue did not complete"))
    stale.span.set_attribute(names.ERROR_TYPE, names.ERROR_TYPE_OTHER)
    stale.span.end()


def _decision_attributes(attempt: Attempt, decision: Mapping[str, Any], retry: bool) -> dict[str, AttributeValue]:
    """The retry decision as span attributes (the same go on the span and on its retry event)."""
    outcome = decision.get("outcome") or ("retry" if retry else "fail")
    delay_ms = decision.get("delay_ms")
    if delay_ms is None and retry:
        delay_ms = attempt.retry_delay_ms
    values: dict[str, AttributeValue] = {names.RETRY_OUTCOME: str(outcome)}
    for key, name in (("category", names.RETRY_CATEGORY), ("reason", names.RETRY_REASON)):
        if isinstance(decision.get(key), str):
            values[name] = decision[key]
    values[names.RETRY_ATTEMPT] = propagation.int_or(decision.get("attempt"), attempt.attempt)
    if is_int(delay_ms):
        values[names.RETRY_DELAY_MS] = delay_ms
    status = decision.get("http_status")
    if is_int(status):
        values[names.HTTP_RESPONSE_STATUS_CODE] = status
    return values


def _inferred_decision(attempt: Attempt, message: MessageProxy) -> dict[str, Any] | None:
    """What Dramatiq's own ``Retries`` did, read from its traces on the message."""
    if message.failed:
        return {"retry": False, "outcome": "fail", "attempt": attempt.attempt}
    if (
        propagation.int_or(message.options.get("retries")) > attempt.retries_before
        or attempt.retry_delay_ms is not None
    ):
        return {"retry": True, "outcome": "retry", "attempt": attempt.attempt, "delay_ms": attempt.retry_delay_ms}
    return None  # no retry middleware: the message is acked and the failure is on the span only
