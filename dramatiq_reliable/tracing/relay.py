"""Relay publish spans: one ``send <queue>`` CLIENT span per message of a relay batch, in the message's trace.

The relay runs in its own process or inside workers, and knows nothing of OpenTelemetry: it
emits ``outbox.batch_published`` with every message of a committed pass and the publish's
wall-clock bounds, and :class:`RelaySpans` turns that into spans timed by the batch.  The kind
is CLIENT, not PRODUCER, because this span's context is not the one that travels with the
message (the conventions keep PRODUCER for that).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from dramatiq.errors import DecodeError
from dramatiq.message import Message
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue

from . import propagation
from . import semconv as names
from .metrics import Instruments
from .propagation import TRACE_CONTEXT_KEY, Propagation

__all__ = []


class RelaySpans:
    """Records the spans and publish metrics of relay batches."""

    def __init__(self, tracer: trace.Tracer, propagation: Propagation, instruments: Instruments) -> None:
        self._tracer = tracer
        self._propagation = propagation
        self._instruments = instruments

    def record(self, event: Any) -> None:
        """One ``send`` span and ``sent`` count per message of the batch; one duration for the batch."""
        messages = tuple(getattr(event, "messages", ()) or ())
        if not messages:
            return
        start_ns = propagation.int_or(getattr(event, "start_time_ns", None), time.time_ns())
        end_ns = max(start_ns, propagation.int_or(getattr(event, "end_time_ns", None), time.time_ns()))
        destinations: set[str] = set()
        for item in messages:
            queue_name = str(getattr(item, "queue_name", "") or "")
            destinations.add(queue_name)
            self._record_one(item, queue_name, len(messages), start_ns, end_ns)
        duration_attributes: dict[str, AttributeValue] = {
            names.MESSAGING_SYSTEM: names.SYSTEM_RABBITMQ,
            names.MESSAGING_OPERATION_TYPE: names.OPERATION_SEND,
            names.MESSAGING_OPERATION_NAME: names.OPERATION_SEND,
        }
        if len(destinations) == 1:
            duration_attributes[names.MESSAGING_DESTINATION_NAME] = destinations.pop()
        self._instruments.operation_duration.record((end_ns - start_ns) / 1e9, duration_attributes)

    def _record_one(self, item: Any, queue_name: str, batch_size: int, start_ns: int, end_ns: int) -> None:
        message_id = str(getattr(item, "message_id", "") or "")
        body = getattr(item, "body", b"")
        error = getattr(item, "error", None)
        options = _options_of(body)
        creation = self._propagation.extract(options.get(TRACE_CONTEXT_KEY))
        creation_sc = propagation.span_context_of(creation)
        attributes: dict[str, AttributeValue] = {
            names.MESSAGING_SYSTEM: names.SYSTEM_RABBITMQ,
            names.MESSAGING_OPERATION_TYPE: names.OPERATION_SEND,
            names.MESSAGING_OPERATION_NAME: names.OPERATION_SEND,
            names.MESSAGING_DESTINATION_NAME: queue_name,
            names.MESSAGING_RABBITMQ_ROUTING_KEY: queue_name,
            names.MESSAGING_MESSAGE_ID: message_id,
            names.MESSAGING_MESSAGE_BODY_SIZE: len(body) if isinstance(body, (bytes, bytearray, memoryview)) else 0,
        }
        if batch_size > 1:
            attributes[names.MESSAGING_BATCH_MESSAGE_COUNT] = batch_size
        replay = propagation.new_replay(options)
        if replay is not None:
            attributes[names.REPLAY_COUNT] = replay
            parent = creation  # the replay goes out in the trace of the job that died
        else:
            parent = propagation.hop_parent(options, creation)
        links = [Link(creation_sc, {names.LINK_ROLE: names.LINK_ROLE_CREATION})] if creation_sc is not None else []
        span = self._tracer.start_span(
            names.span_name(names.OPERATION_SEND, queue_name),
            context=parent or otel_context.Context(),
            kind=SpanKind.CLIENT,
            attributes=attributes,
            links=links,
            start_time=start_ns,
        )
        metric_attributes: dict[str, AttributeValue] = {
            names.MESSAGING_SYSTEM: names.SYSTEM_RABBITMQ,
            names.MESSAGING_DESTINATION_NAME: queue_name,
            names.MESSAGING_OPERATION_NAME: names.OPERATION_SEND,
        }
        if error is not None:
            error_type = _publish_error_type(str(error))
            span.set_status(Status(StatusCode.ERROR, str(error)[: names.ATTRIBUTE_VALUE_MAX_CHARS]))
            span.set_attribute(names.ERROR_TYPE, error_type)
            metric_attributes[names.ERROR_TYPE] = error_type
        span.end(end_time=end_ns)
        self._instruments.sent.add(1, metric_attributes)


def _options_of(body: object) -> Mapping[str, Any]:
    """The options of an encoded message, or none when the body is not one Dramatiq can decode."""
    if not isinstance(body, (bytes, bytearray, memoryview)):
        return {}
    try:
        options = Message.decode(bytes(body)).options
    except (DecodeError, TypeError, ValueError, AttributeError):
        return {}
    return options if isinstance(options, Mapping) else {}


def _publish_error_type(error: str) -> str:
    """``error.type`` of a refused publish, from the relay's error text."""
    text = error.lower()
    if text.startswith("unroutable"):
        return "unroutable"
    if "nack" in text:
        return "nacked"
    return names.ERROR_TYPE_OTHER
