"""The event bridge: the package's instrumentation events become span events, span attributes and metrics.

The other parts know nothing of OpenTelemetry; they emit :mod:`dramatiq_reliable.events`, which
:class:`EventBridge` receives in the emitting thread.  An event about the message being
processed on that thread becomes an event of its attempt's span (``idempotency.duplicate`` also
marks the span and counts the duplicate; a ``retry.*`` event stops Tracing writing its own).
One emitted right after the attempt ended, from the ack/nack hooks (``dead_letter.stored``),
becomes a short INTERNAL child of the attempt's span.  ``outbox.batch_published`` goes to the
relay spans.  Anything else is left to the logging listener.

An event's fields are converted to attributes only when a recording span will hold them: most
events find no span (relay threads, the CLI) or a non-recording one (no SDK, sampled out).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.trace import SpanKind
from opentelemetry.util.types import AttributeValue

from .. import events
from . import semconv as names
from .metrics import Instruments
from .relay import RelaySpans
from .spans import SpanRecorder

__all__ = []


class EventBridge:
    """An :mod:`~dramatiq_reliable.events` listener that puts events on the spans they belong to."""

    def __init__(self, tracer: trace.Tracer, spans: SpanRecorder, relay: RelaySpans, instruments: Instruments) -> None:
        self._tracer = tracer
        self._spans = spans
        self._relay = relay
        self._instruments = instruments

    def __repr__(self) -> str:
        # What events.emit names when a listener fails: say whose it is.
        return "<Tracing event bridge>"

    def __call__(self, event: events.Event) -> None:
        name = str(getattr(event, "name", "") or "event")
        if name == names.RELAY_BATCH_EVENT:
            self._relay.record(event)
            return
        fields = _Fields(event)
        message_id = fields.get("message_id")
        state = self._spans.current()
        attempt = state.attempt if state is not None else None
        finished = state.finished if state is not None else None
        destination: str | None = None
        if attempt is not None and (message_id is None or message_id == attempt.message_id):
            if attempt.span.is_recording():
                attempt.span.add_event(name, fields.attributes())
            destination = attempt.destination
            if name.startswith(names.RETRY_EVENT_PREFIX):
                attempt.retry_event_seen = True
            elif name == names.DUPLICATE_EVENT:
                attempt.span.set_attribute(names.DUPLICATE, True)
            elif name == names.SINGLETON_HELD_EVENT:
                attempt.span.set_attribute(names.SINGLETON_HELD, str(fields.get("action")))
        elif finished is not None and message_id == finished.message_id:
            # Emitted from the ack/nack hooks, after the attempt's span ended: a short child.
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
            if span.is_recording():
                span.add_event(name, fields.attributes())
            span.end()
        if name == names.DUPLICATE_EVENT:
            queue = destination or fields.get("queue_name")
            self._instruments.duplicates.add(1, {names.MESSAGING_DESTINATION_NAME: str(queue)} if queue else {})
        elif name == names.SINGLETON_HELD_EVENT:
            held = {names.SINGLETON_HELD: str(fields.get("action"))}
            if destination:
                held[names.MESSAGING_DESTINATION_NAME] = destination
            self._instruments.singleton_held.add(1, held)


class _Fields:
    """An event's fields as span-event attributes, converted when first needed.

    Looking up one field of an event that keeps :meth:`events.Event.as_attributes` (its
    dataclass fields) reads that field alone; any other event's ``as_attributes()`` is called
    once, on first use.
    """

    __slots__ = ("_all", "_event")

    def __init__(self, event: object) -> None:
        self._event = event
        self._all: dict[str, AttributeValue] | None = None

    def get(self, key: str) -> AttributeValue | None:
        plain = _plain_fields(type(self._event))
        if plain is None or self._all is not None:
            return self.attributes().get(key)
        if key not in plain:
            return None
        value = getattr(self._event, key)
        return None if value is None else _attribute_value(value)

    def attributes(self) -> dict[str, AttributeValue]:
        if self._all is None:
            as_attributes = getattr(self._event, "as_attributes", None)
            raw = as_attributes() if callable(as_attributes) else {}
            self._all = {str(key): _attribute_value(value) for key, value in (raw or {}).items() if value is not None}
        return self._all


# Per event class (weakly: a class defined in a function may go away); a race only computes
# the same answer twice.
_PLAIN_FIELDS: weakref.WeakKeyDictionary[type, frozenset[str] | None] = weakref.WeakKeyDictionary()


def _plain_fields(cls: type) -> frozenset[str] | None:
    """The fields of an event class whose attributes are its dataclass fields; ``None`` for any other."""
    try:
        return _PLAIN_FIELDS[cls]
    except KeyError:
        pass
    plain = None
    if dataclasses.is_dataclass(cls) and getattr(cls, "as_attributes", None) is events.Event.as_attributes:
        plain = frozenset(field.name for field in dataclasses.fields(cls))
    _PLAIN_FIELDS[cls] = plain
    return plain


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
