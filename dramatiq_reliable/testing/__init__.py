"""Helpers for testing code that uses dramatiq-reliable: polling and a synchronous outbox drain.

>>> from dramatiq_reliable.testing import drain_outbox, wait_for
>>> with broker.transaction():                       # doctest: +SKIP
...     place_order.send(42)
>>> drain_outbox(broker)                             # doctest: +SKIP
1
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from ..outbox.broker import OutboxBroker
from ..outbox.relay import Relay
from .dead_letters import InMemoryDeadLetterStore
from .idempotency import InMemoryIdempotencyStore

__all__ = ["InMemoryDeadLetterStore", "InMemoryIdempotencyStore", "drain_outbox", "wait_for"]

T = TypeVar("T")


def wait_for(condition: Callable[[], T], *, timeout_ms: int = 10_000, interval_ms: int = 20, message: str = "") -> T:
    """Poll ``condition`` until it returns something truthy and return that; fail after ``timeout_ms``."""
    deadline = time.monotonic() + timeout_ms / 1000
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"condition not met within {timeout_ms} ms" + (f": {message}" if message else ""))
        time.sleep(interval_ms / 1000)


def drain_outbox(broker: OutboxBroker, **relay_options: Any) -> int:
    """Publish every committed outbox row of ``broker`` to RabbitMQ now; return the count."""
    relay = Relay.from_broker(broker, **relay_options)
    try:
        return relay.drain()
    finally:
        relay.publisher.close()
