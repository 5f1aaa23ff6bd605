"""The event bridge: the package's instrumentation events become span events, span attributes and metrics.

The other parts know nothing of OpenTelemetry; they emit :mod:`dramatiq_reliable.events`, which
:class:`EventBridge` receives in the emitting thread.  An event about the message being
processed on that thread becomes an event of its attempt's span (``idempotency.duplicate`` also
marks the span and counts the duplicate; a ``retry.*`` event stops Tracing writing its own).
One emitted right after the attempt ended, from the ack/nack hooks (``dead_letter.stored``),
becomes a short INTERNAL child of the attempt's span.  ``outbox.batch_published`` goes to the
relay spans.  Anything else is left to the logging listener.
"""

from __future__ import annotations

from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.trace import SpanKind
from opentelemetry.util.types import AttributeValue

from .. import events
from . import semconv as names
from .metrics import Instruments
from .relay import RelaySpans
from .spans import SpanRecorder

__all__ = ["EventBridge"]


class EventBridge:
    """An :mod:`~dramatiq_reliable.events` listener that puts events on the spans they belong to."""

    def __init__(self, tracer: trace.Tracer, spans: SpanRecorder, relay: RelaySpans, instruments: Instruments) -> None:
        self._tracer = tracer
        self._spans = spans
        self._relay = relay
        self._instruments = instruments

    def __call__(self, event: events.Event) -> None:
        name = str(getattr(event, "name", "") or "event")
        if name == names.RELAY_BATCH_EVENT:
            self._relay.record(event)
            return
        attributes = _event_attributes(event)
        message_id = attributes.get("message_id")
        state = self._spans.state()
        attempt = state.attempt
        destination: str | None = None
        if attempt is not None and (message_id is None or message_id == attempt.message_id):
            attempt.span.add_event(name, attributes)
            destination = attempt.destination
            if name.startswith(names.RETRY_EVENT_PREFIX):
                attempt.retry_event_seen = True
            elif name == names.DUPLICATE_EVENT:
                attempt.span.set_attribute(names.DUPLICATE, True)
        elif state.finished is not None and message_id == state.finished.message_id:
            # Emitted from the ack/nack hooks, after the attempt's span ended: a short child.
            finished = state.finished
            destination = finished.destination
            span = self._tracer.start_span(
                name,
                context=trace.set_span_in_context(trace.NonRecordingSpan(finished.span_context)),
                kind=SpanKind.INTERNAL,
                attributes={
                    names.MESSAGING_MESSAGE_ID: finished.message_id,
                    names.MESSAGING_DESTINATION_NAME: destination,
                },
            )
            span.add_event(name, attributes)
            span.end()
        if name == names.DUPLICATE_EVENT:
            queue = destination or attributes.get("queue_name")
            self._instruments.duplicates.add(1, {names.MESSAGING_DESTINATION_NAME: str(queue)} if queue else {})


def _event_attributes(event: object) -> dict[str, AttributeValue]:
    """An event's fields as span-event attributes: scalars kept, anything else as short text."""
    as_attributes = getattr(event, "as_attributes", None)
    raw = as_attributes() if callable(as_attributes) else {}
    return {str(key): _attribute_value(value) for key, value in (raw or {}).items() if value is not None}


def _attribute_value(value: object) -> AttributeValue:
    """Scalars kept, strings and sequences of strings cut short, anything else as short text."""
    limit = names.ATTRIBUTE_VALUE_MAX_CHARS
    if isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, str):
        return value[:limit]
    if isinstance(value, Sequence) and all(isinstance(item, str) for item in value):
        return tuple(str(item)[:limit] for item in value)
    return str(value)[:limit]
