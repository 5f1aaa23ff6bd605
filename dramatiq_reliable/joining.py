"""``join()`` for every Postgres-backed broker: wait until a queue stays empty, as Dramatiq's RabbitMQ broker does.

Dramatiq's ``RabbitmqBroker.join(queue_name, min_successes=10, idle_time=100, *, timeout=None)``
counts the queue every ``idle_time`` milliseconds and returns once it was empty
``min_successes`` times in a row, raising ``QueueJoinTimeout`` after ``timeout`` milliseconds.
Users' tests are written against that contract, so ``PostgresBroker`` and ``OutboxBroker``
keep it and differ only in what they count: the queue rows of a ``PostgresBroker`` (running
ones included), and for an ``OutboxBroker`` the queue's unpublished outbox rows as well as
RabbitMQ's queue and delay queue.  Several empty counts in a row, not one, because a message
still running may send another to the same queue.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from dramatiq.errors import QueueJoinTimeout

from ._checks import check_int, check_ms

# Internal: the names below are used by other parts of the package, not by applications.
__all__: list[str] = []


def join_until_empty(
    queue_name: str,
    count: Callable[[], int],
    *,
    min_successes: int,
    idle_time: int,
    timeout: int | None,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Return once ``count()`` was 0 ``min_successes`` times in a row, counted every ``idle_time`` ms.

    Raises ``QueueJoinTimeout`` when that has not happened ``timeout`` milliseconds after the
    call (``None``: wait for ever); the last count is made at the deadline, so a queue that
    empties just in time is not reported as late.  ``timeout=0`` counts once.
    """
    check_int("min_successes", min_successes, minimum=1, fix="e.g. min_successes=10, as RabbitmqBroker.join")
    check_ms("idle_time", idle_time, fix="give the milliseconds between counts, e.g. idle_time=100")
    check_ms("timeout", timeout, allow_none=True, fix="give milliseconds, e.g. timeout=10_000, or None to wait")
    deadline = None if timeout is None else time.monotonic() + timeout / 1000
    successes = 0
    while True:
        successes = successes + 1 if count() == 0 else 0
        if successes >= min_successes:
            return
        if deadline is None:
            sleep(idle_time / 1000)
            continue
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise QueueJoinTimeout(queue_name)  # type: ignore[no-untyped-call]
        sleep(min(idle_time / 1000, remaining))
