"""Instrumentation events: small frozen records that every part emits and any listener can watch.

Each middleware describes what it did as an event (a retry scheduled, a duplicate skipped, a dead
letter stored, outbox rows published) and hands it to :func:`emit`.  Listeners turn events into
logs, metrics or span events; the ``Tracing`` middleware is one.  Keeping the parts ignorant of
OpenTelemetry keeps ``opentelemetry-api`` optional at the call sites and makes tests simple:
subscribe a list's ``append`` and assert on what arrives.

>>> from dramatiq_reliable import events
>>> seen = []
>>> events.subscribe(seen.append)
>>> events.unsubscribe(seen.append)

A listener that raises is logged and skipped; it never breaks the job that emitted the event.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Any, ClassVar

__all__ = ["Event", "Listener", "emit", "has_listeners", "subscribe", "unsubscribe"]

logger = logging.getLogger("dramatiq_reliable.events")


@dataclasses.dataclass(frozen=True)
class Event:
    """Base of every event.  ``name`` is a stable, low-cardinality identifier such as
    ``"retry.scheduled"``; ``level`` is the log level the default logging listener uses."""

    name: ClassVar[str] = "event"
    level: ClassVar[int] = logging.INFO

    def as_attributes(self) -> dict[str, Any]:
        """The event's fields as a flat dict, ``None`` values dropped (for logs and spans)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


Listener = Callable[[Event], None]

_lock = threading.Lock()
# Copy-on-write tuple: emit() reads it without taking the lock on the hot path.
_listeners: tuple[Listener, ...] = ()


def subscribe(listener: Listener) -> None:
    """Call ``listener(event)`` for every event emitted from now on, in any thread."""
    global _listeners
    with _lock:
        if listener not in _listeners:
            _listeners = (*_listeners, listener)


def unsubscribe(listener: Listener) -> None:
    """Stop calling ``listener``.  Unknown listeners are ignored."""
    global _listeners
    with _lock:
        _listeners = tuple(item for item in _listeners if item != listener)


def has_listeners() -> bool:
    """Whether anyone listens: lets an emitter skip building a costly event nobody reads."""
    return bool(_listeners)


def emit(event: Event) -> None:
    """Log ``event`` and hand it to every listener, synchronously, in the calling thread."""
    if logger.isEnabledFor(event.level):
        logger.log(event.level, "%s %s", event.name, _format(event.as_attributes()))
    for listener in _listeners:
        try:
            listener(event)
        except Exception:
            logger.exception("event listener %r failed on %s; the event was dropped for it", listener, event.name)


def _format(attributes: dict[str, Any]) -> str:
    # Durations are floats of milliseconds: three decimals are plenty for a log line.
    return " ".join(
        f"{key}={round(value, 3) if isinstance(value, float) else value!r}" for key, value in attributes.items()
    )
