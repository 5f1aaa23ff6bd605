"""Helpers for testing code that uses dramatiq-reliable: polling, a synchronous outbox drain, an in-memory broker.

The pytest fixtures built on them are in :mod:`dramatiq_reliable.testing.plugin` (loaded by
pytest on its own; see docs/testing-your-actors.md).

>>> from dramatiq_reliable.testing import drain_outbox, wait_for
>>> with broker.transaction():                       # doctest: +SKIP
...     place_order.send(42)
>>> drain_outbox(broker)                             # doctest: +SKIP
1
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from .._checks import check_ms
from ..database import DatabaseLike
from ..outbox.broker import OutboxBroker
from ..outbox.relay import OnPublished, Relay, RelayOptions
from .assertions import assert_enqueued, assert_enqueued_count, assert_not_enqueued, enqueued
from .broker import InMemoryBroker
from .dead_letters import InMemoryDeadLetterStore
from .idempotency import InMemoryIdempotencyStore

__all__ = [
    "InMemoryBroker",
    "InMemoryDeadLetterStore",
    "InMemoryIdempotencyStore",
    "assert_enqueued",
    "assert_enqueued_count",
    "assert_not_enqueued",
    "drain_outbox",
    "enqueued",
    "wait_for",
]

T = TypeVar("T")


def wait_for(
    condition: Callable[[], T],
    *,
    timeout_ms: int = 10_000,
    interval_ms: int = 20,
    message: str | Callable[[], str] = "",
) -> T:
    """Poll ``condition`` until it returns something truthy and return that; fail after ``timeout_ms``.

    ``message`` is added to the failure; pass a callable to describe the state *at the failure*
    (an f-string is evaluated before the wait starts, so it shows the state before the wait).
    """
    check_ms("timeout_ms", timeout_ms)
    check_ms("interval_ms", interval_ms, minimum=1)
    deadline = time.monotonic() + timeout_ms / 1000
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            said = _describe(message)
            raise AssertionError(f"condition not met within {timeout_ms} ms" + (f": {said}" if said else ""))
        time.sleep(interval_ms / 1000)


def _describe(message: str | Callable[[], str]) -> str:
    if not callable(message):
        return message
    try:
        return message()
    except Exception as error:  # the wait failed: say so even if describing it fails too
        return f"(describing the failure raised {type(error).__name__}: {error})"


def drain_outbox(
    broker: OutboxBroker,
    *,
    batch_size: int = RelayOptions.batch_size,
    poll_interval_ms: int = RelayOptions.poll_interval_ms,
    on_published: OnPublished = RelayOptions.on_published,
    retention_ms: int | None = RelayOptions.retention_ms,
    purge_interval_ms: int = RelayOptions.purge_interval_ms,
    confirm_timeout_ms: int = RelayOptions.confirm_timeout_ms,
    backoff_min_ms: int = RelayOptions.backoff_min_ms,
    backoff_max_ms: int = RelayOptions.backoff_max_ms,
    row_backoff_max_ms: int = RelayOptions.row_backoff_max_ms,
    listen: bool = RelayOptions.listen,
    max_batch_bytes: int = RelayOptions.max_batch_bytes,
    max_attempts: int | None = RelayOptions.max_attempts,
    statement_timeout_ms: int = RelayOptions.statement_timeout_ms,
    listen_database: DatabaseLike | None = RelayOptions.listen_database,
) -> int:
    """Publish every committed outbox row of ``broker`` that is due to RabbitMQ now; return the count.

    A delayed message's row is due at its eta: until then it stays in the outbox (where
    ``broker.join()`` still counts it), as a relay would leave it.

    The options are :class:`~dramatiq_reliable.Relay`'s (``on_published="delete"``, say); the
    drain runs on the calling thread and closes its RabbitMQ connection before it returns.
    """
    relay = Relay.from_broker(
        broker,
        batch_size=batch_size,
        poll_interval_ms=poll_interval_ms,
        on_published=on_published,
        retention_ms=retention_ms,
        purge_interval_ms=purge_interval_ms,
        confirm_timeout_ms=confirm_timeout_ms,
        backoff_min_ms=backoff_min_ms,
        backoff_max_ms=backoff_max_ms,
        row_backoff_max_ms=row_backoff_max_ms,
        listen=listen,
        max_batch_bytes=max_batch_bytes,
        max_attempts=max_attempts,
        statement_timeout_ms=statement_timeout_ms,
        listen_database=listen_database,
    )
    try:
        return relay.drain()
    finally:
        relay.publisher.close()
