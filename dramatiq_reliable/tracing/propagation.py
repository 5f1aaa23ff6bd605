"""Where a job's trace context travels: keys of ``message.options`` and how they are read and written.

RabbitMQ carries only the JSON body here (Dramatiq publishes no AMQP headers), so the options
are the envelope.  Everything in them was written by another process, maybe another version:
it is read defensively and a value that does not parse is treated as absent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.propagators.textmap import TextMapPropagator
from opentelemetry.trace import SpanContext
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from .._checks import is_int

__all__ = ["PREVIOUS_ATTEMPT_KEY", "TRACE_CONTEXT_KEY", "TRACE_ORIGIN_KEY", "TRACE_REPLAY_KEY"]

#: The creation context, as the propagator writes it (``{"traceparent": ..., "tracestate": ...}``).
TRACE_CONTEXT_KEY: Final = "trace_context"
#: The span context of the latest processing attempt (W3C ``traceparent``), for the next one's link.
PREVIOUS_ATTEMPT_KEY: Final = "trace_previous_attempt"
#: A replay's original creation context, kept when the replay starts a trace of its own.
TRACE_ORIGIN_KEY: Final = "trace_origin"
#: The replay (``replay_of["count"]``) whose trace was started, so a replay's retries stay in it.
TRACE_REPLAY_KEY: Final = "trace_replay"
# Written by the other parts; read defensively, as they may be absent.
RETRY_DECISION_KEY: Final = "retry_decision"
REPLAY_OF_KEY: Final = "replay_of"
#: W3C traceparents of the group a workflow step joins (workflows/workflow.py writes them).
WORKFLOW_LINKS_KEY: Final = "workflow_links"

# The previous attempt is a span reference, not a context to propagate: always W3C, whatever
# propagator the application configured, so baggage is not copied into it.
_W3C = TraceContextTextMapPropagator()


class Propagation:
    """Reads and writes the creation context with the configured propagator (the global one if
    none was given, looked up at each use so the application may configure it later)."""

    def __init__(self, propagator: TextMapPropagator | None) -> None:
        self.configured = propagator

    def propagator(self) -> TextMapPropagator:
        return self.configured if self.configured is not None else propagate.get_global_textmap()

    def extract(self, value: object) -> otel_context.Context | None:
        """The context in a carrier read from the options, or ``None`` if it holds no valid span."""
        values = carrier(value)
        if not values:
            return None
        ctx = self.propagator().extract(values, context=otel_context.Context())
        return ctx if span_context_of(ctx) is not None else None

    def inject(self, ctx: otel_context.Context | None = None) -> dict[str, str]:
        """A carrier for ``ctx`` (the current context by default); empty when there is no valid span."""
        values: dict[str, str] = {}
        self.propagator().inject(values, context=ctx)
        return values


def carrier(value: object) -> dict[str, str]:
    """The string entries of a mapping read from the options (anything else: empty)."""
    if not isinstance(value, Mapping):
        return {}
    return {str(key): str(item) for key, item in value.items() if isinstance(item, str)}


def span_context_of(ctx: otel_context.Context | None) -> SpanContext | None:
    """The valid span context in ``ctx``, or ``None``."""
    if ctx is None:
        return None
    span_context = trace.get_current_span(ctx).get_span_context()
    return span_context if span_context.is_valid else None


def previous_attempt(options: Mapping[str, Any]) -> SpanContext | None:
    """The span context of the attempt before this one, if an earlier attempt recorded it."""
    return span_context_of(_W3C.extract(carrier(options.get(PREVIOUS_ATTEMPT_KEY))))


def record_attempt(options: dict[str, Any]) -> None:
    """Write the current span (the attempt that just started) as the next attempt's previous one."""
    values: dict[str, str] = {}
    _W3C.inject(values)
    options[PREVIOUS_ATTEMPT_KEY] = values


def hop_parent(options: Mapping[str, Any], creation: otel_context.Context | None) -> otel_context.Context | None:
    """The parent of a publish of an existing message: the attempt that scheduled it, if any.

    A retry is published (by the relay, then the delay-queue hop) because an attempt failed;
    under that attempt the trace reads in order.  Only within one trace: a replay's previous
    attempt belongs to the trace that died.
    """
    previous = previous_attempt(options)
    creation_sc = span_context_of(creation)
    if previous is not None and (creation_sc is None or previous.trace_id == creation_sc.trace_id):
        return trace.set_span_in_context(trace.NonRecordingSpan(previous), otel_context.Context())
    return creation


def workflow_children(options: Mapping[str, Any]) -> list[SpanContext]:
    """The span contexts of the group's runs a workflow step joins (none when absent or unparsable)."""
    values = options.get(WORKFLOW_LINKS_KEY)
    if not isinstance(values, list):
        return []
    found = (span_context_of(_W3C.extract({"traceparent": v})) for v in values if isinstance(v, str))
    return [sc for sc in found if sc is not None]


def replay_count(options: Mapping[str, Any]) -> int | None:
    """Which replay of a dead letter this message is (``replay_of["count"]``), or ``None``."""
    replay = options.get(REPLAY_OF_KEY)
    if isinstance(replay, Mapping):
        return int_or(replay.get("count"), 1)
    if replay is not None:
        return 1
    return None


def new_replay(options: Mapping[str, Any]) -> int | None:
    """The replay count if this message is a replay whose own trace has not been started yet."""
    replay = replay_count(options)
    return replay if replay is not None and options.get(TRACE_REPLAY_KEY) != replay else None


def int_or(value: object, default: int = 0) -> int:
    """``value`` if another part wrote an int there (never a bool), else ``default``."""
    return value if is_int(value) else default
