"""The worker's delivery limit on quorum queues: a message that keeps killing workers becomes a dead letter.

A message whose job crashes the worker process (a segfault in a C extension, the OOM killer,
a ``SIGKILL`` from a supervisor) is never nacked: RabbitMQ gets it back when the connection
drops and delivers it again, to the next worker, forever.  Dramatiq's retries never see it,
since no exception is raised.  Quorum queues count these returns in the ``x-delivery-count``
header (0 on the first delivery), so the consumer can tell.

When a delivery arrives with ``x-delivery-count >= delivery_limit``, the consumer does not hand
it to a worker thread: it fails the message with :class:`~dramatiq_reliable.errors.DeliveryLimitReached`
and nacks it through the worker's usual path, so every middleware's ``before_nack`` runs:
``DeadLetters`` stores it in the ``dead_letters`` table (reason ``delivery_limit``, attempts =
the count), and the nack moves it to ``.XQ``, exactly like any other dead message.  If Postgres
is down then, the ``.XQ`` copy is the one ``dead-letters import-xq`` brings over later.  RabbitMQ's
own ``x-delivery-limit`` (a few above ours, :mod:`~dramatiq_reliable.outbox.queues`) is only a
backstop, for a worker that dies while doing this; it also dead-letters to ``.XQ``.

The screen is one function (:func:`screen`) over the consumer's ``(method, properties, body)``
deliveries, so any consumer class can apply it.  Classic queues send no count: nothing is
screened there.  Prefetched messages count too: with ``prefetch`` above 1, a crash returns every
message the worker held, so keep ``delivery_limit`` well above 1 (the default is 20).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from dramatiq.errors import DecodeError
from dramatiq.message import Message

from ..errors import DeliveryLimitReached
from .consumer import ChannelBoundConsumer, _delivery_count

__all__: list[str] = []

logger = logging.getLogger("dramatiq_reliable.outbox.delivery_limit")

RawDelivery = tuple[Any, Any, Any]  # (pika method, pika properties, body) as BlockingChannel.consume yields


def over_limit(properties: Any, limit: int | None) -> int | None:
    """The delivery count if it reached ``limit`` (the message must not run again), else ``None``."""
    count = _delivery_count(properties)
    return count if limit is not None and count is not None and count >= limit else None


def screen(
    consumer: ChannelBoundConsumer, deliveries: Iterator[RawDelivery], limit: int | None, queue_name: str
) -> Iterator[RawDelivery]:
    """``deliveries`` with those over ``limit`` dead-lettered by ``consumer`` and replaced by idle ticks.

    Runs on the consumer thread, which owns ``consumer``'s channel.
    """
    for delivery in deliveries:
        method, properties, body = delivery
        count = over_limit(properties, limit) if method is not None else None
        if count is None:
            yield delivery
            continue
        _retire(consumer, method, properties, body, count, limit or 0, queue_name)
        yield None, None, None  # an idle tick for the worker's loop


def _retire(
    consumer: ChannelBoundConsumer, method: Any, properties: Any, body: bytes, count: int, limit: int, queue_name: str
) -> None:
    tag = method.delivery_tag
    try:
        message = Message.decode(body)
    except DecodeError:
        logger.error("undecodable message over the delivery limit in %r moved to its dead-letter queue", queue_name)
        consumer._nack(tag)  # type: ignore[no-untyped-call]
        return
    proxy = consumer.delivered(method, properties, message)  # bound to this channel, so its nack goes through
    error = DeliveryLimitReached(
        f"message {message.message_id} (actor {message.actor_name!r}) came back unacked from {count} deliveries on "
        f"quorum queue {queue_name!r} (delivery_limit={limit}): each time the worker died or lost its connection "
        "while holding it; not run again. Find why the job kills its worker (memory, a native crash, a supervisor's "
        "timeout), then replay it",
        deliveries=count,
    )
    proxy.stuff_exception(error)
    proxy.fail()
    logger.error("%s", error)
    # The worker's nack path (before_nack: DeadLetters stores it; the nack; after_nack), without
    # ConsumerThread.post_process_message's retry loop: on this thread a connection error must
    # reach the worker, which restarts the consumer; the redelivery is screened again.
    consumer.broker.emit_before("nack", proxy)
    consumer.nack(proxy)
    consumer.broker.emit_after("nack", proxy)


class LimitedConsumer(ChannelBoundConsumer):
    """The channel-bound consumer with :func:`screen` over its deliveries (quorum queues only)."""

    def __init__(self, broker: Any, queue_name: str, prefetch: int, timeout: int) -> None:
        super().__init__(broker, queue_name, prefetch, timeout)
        settings = getattr(broker, "queue_settings", None)
        limit = settings.limit_of(queue_name) if settings is not None else None
        if limit is not None:
            self.iterator = screen(self, self.iterator, limit, queue_name)
