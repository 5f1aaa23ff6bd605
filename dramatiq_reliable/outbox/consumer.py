"""Deliveries and their channel: a message is acked or nacked only on the channel that delivered it.

Dramatiq 2.2.1's RabbitMQ consumer acks by delivery tag on whatever channel the consumer thread
holds *now*.  When RabbitMQ closes a channel (``consumer_timeout`` under a long job, a node
restart, any channel error) the thread reconnects and tags restart at 1, so the late ack of a
message from the old channel removes whichever message holds that number on the new one; if the
worker then dies before running it, that message is gone: no effect, no dead letter, no queue.

:class:`ChannelBoundConsumer` (``OutboxBroker.consumer_class``) remembers which consumer, hence
which channel, delivered each message.  A message is acked or nacked on that channel while it is
open, and never on another: RabbitMQ has already put the message back in the queue when its
channel closed, so the copy it delivers again decides (``Idempotency`` skips it when the first
run committed; a failure is dead-lettered by that copy).  Each such refusal logs one warning.

What RabbitMQ said when it delivered a message is :func:`delivery_of`'s :class:`Delivery`:
the tag, the redelivered flag, the ``x-delivery-count`` header of quorum queues,
and which channel it came on.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Any

import pika
from dramatiq.broker import MessageProxy
from dramatiq.brokers.rabbitmq import _RabbitmqConsumer
from dramatiq.common import q_name
from dramatiq.errors import ConnectionClosed, DecodeError
from dramatiq.message import Message, get_encoder

__all__ = ["ChannelBoundConsumer", "Delivery", "ack_now", "delivery_of"]

logger = logging.getLogger("dramatiq_reliable.outbox")

#: Channel numbers repeat after every reconnect (each connection's first channel is 1), so each
#: consumer gets a serial of its own: two deliveries with the same serial share a channel.
_serials = itertools.count(1)


@dataclass(frozen=True)
class Delivery:
    """What RabbitMQ said when it delivered a message to this process.

    Attributes:
      queue_name: the queue it was consumed from.
      delivery_tag: its number on its channel (meaningless on any other channel).
      redelivered: RabbitMQ's flag: the message was delivered before (to any consumer).
      delivery_count: the ``x-delivery-count`` header of quorum queues: how many earlier
        deliveries of the message came back unacked (0 on a first delivery, as seen on RabbitMQ
        3.10); ``None`` on classic queues, which send none.
      channel_id: which channel delivered it: a serial unique in this process, since AMQP
        channel numbers start again at 1 on every connection.
      channel_number: the AMQP channel number, as RabbitMQ's logs show it.

    >>> delivery = delivery_of(message)                            # doctest: +SKIP
    >>> delivery.delivery_count if delivery else None              # doctest: +SKIP
    """

    queue_name: str
    delivery_tag: int
    redelivered: bool
    delivery_count: int | None
    channel_id: int
    channel_number: int


class _DeliveredMessage(MessageProxy):
    """A message with its :class:`Delivery` and the consumer (the channel) that must ack it."""

    def __init__(self, message: Message[Any], delivery: Delivery, consumer: ChannelBoundConsumer) -> None:
        super().__init__(message)
        self.redelivered = delivery.redelivered
        self._tag = delivery.delivery_tag
        self._delivery = delivery
        self._consumer = consumer
        # Acked before the job ended (ack_now): the worker's own ack or reject is then a no-op.
        self._settled = False


def delivery_of(message: Any) -> Delivery | None:
    """The :class:`Delivery` of a message a ``ChannelBoundConsumer`` delivered, else ``None``.

    Middleware receive the message proxy the consumer made, so any hook can ask: a quorum
    queue's delivery count, or whether two messages came on the same channel.  Messages from other
    brokers (``StubBroker``, ``PostgresBroker``) and messages built in code have none.
    """
    delivery = message.__dict__.get("_delivery") if isinstance(message, MessageProxy) else None
    return delivery if isinstance(delivery, Delivery) else None


def ack_now(message: Any) -> bool:
    """Ack ``message``'s delivery now, on the channel that delivered it; whether that was possible.

    For a job that keeps running after RabbitMQ has let go of it (a long job whose lease in
    Postgres now holds it): the worker's ack or reject at the end is then skipped.  Returns
    ``False`` when the message did not come from a ``ChannelBoundConsumer`` or its channel has
    closed (RabbitMQ then delivers it again on its own).
    """
    consumer = message.__dict__.get("_consumer") if isinstance(message, _DeliveredMessage) else None
    if not isinstance(consumer, ChannelBoundConsumer) or not consumer.channel.is_open:
        return False
    if not message._settled:
        consumer.ack(message)
        message._settled = True
    return True


def _delivery_count(properties: Any) -> int | None:
    headers = getattr(properties, "headers", None) or {}
    count = headers.get("x-delivery-count")
    # pika decodes it as an int subclass of its own: a plain int for logs and events.
    return int(count) if isinstance(count, int) and not isinstance(count, bool) else None


def _settled(message: MessageProxy) -> bool:
    return bool(message.__dict__.get("_settled", False))


class ChannelBoundConsumer(_RabbitmqConsumer):
    """Dramatiq's RabbitMQ consumer, with acks and nacks bound to the channel that delivered.

    One consumer is one connection and one channel; the worker's consumer thread makes a new
    one after any connection or channel error.  Messages carry their consumer, and
    :meth:`ack`/:meth:`nack` refuse a message delivered by another consumer or by a channel
    that has closed: its tag would name a different message, or none.
    """

    def __init__(self, broker: Any, queue_name: str, prefetch: int, timeout: int) -> None:
        super().__init__(broker, queue_name, prefetch, timeout)  # type: ignore[no-untyped-call]
        self.serial = next(_serials)

    def __next__(self) -> _DeliveredMessage | None:
        try:
            method, properties, body = next(self.iterator)
            if method is None:
                return None
        except (AssertionError, pika.exceptions.AMQPConnectionError, pika.exceptions.AMQPChannelError) as error:
            # As Dramatiq: a vanished queue is declared again when the consumer restarts.
            if getattr(error, "reply_code", None) == 404:
                self.broker.queues_pending.add(q_name(self.queue_name))
            raise ConnectionClosed(error) from None  # type: ignore[no-untyped-call]

        try:
            message = Message.decode(body)
        except DecodeError:
            logger.exception("failed to decode a message with encoder %r; rejecting it", get_encoder())
            self._nack(method.delivery_tag)  # type: ignore[no-untyped-call]
            return None

        return self.delivered(method, properties, message)

    def delivered(self, method: Any, properties: Any, message: Message[Any]) -> _DeliveredMessage:
        """The proxy of a message this consumer's channel delivered, bound to this channel for its ack.

        Anything that takes deliveries off the channel itself (a screen that dead-letters some
        before a worker sees them) makes its proxies here, or they cannot be acked or nacked.
        """
        delivery = Delivery(
            queue_name=self.queue_name,
            delivery_tag=method.delivery_tag,
            redelivered=bool(method.redelivered),
            delivery_count=_delivery_count(properties),
            channel_id=self.serial,
            channel_number=int(self.channel.channel_number),
        )
        self.known_tags.add(method.delivery_tag)
        return _DeliveredMessage(message, delivery, self)

    def ack(self, message: MessageProxy) -> None:
        if _settled(message):
            return
        if self._owns(message, "acking"):
            super().ack(message)  # type: ignore[no-untyped-call]

    def nack(self, message: MessageProxy) -> None:
        if _settled(message):
            # Acked at the start of a long job: RabbitMQ has nothing left to reject; DeadLetters
            # keeps the failure in Postgres as for any other message.
            return
        if self._owns(message, "rejecting"):
            super().nack(message)  # type: ignore[no-untyped-call]

    def _owns(self, message: MessageProxy, action: str) -> bool:
        """Whether ``message`` came on this consumer's channel and that channel is still open."""
        delivery = delivery_of(message)
        if delivery is not None and delivery.channel_id == self.serial and self.channel.is_open:
            return True
        channel = f"channel #{delivery.channel_id}" if delivery else "an unknown channel"
        logger.warning(
            "not %s message %r (%s): it was delivered on %s, which is closed (consumer_timeout, a "
            "restart or a channel error); RabbitMQ delivers it again, and Idempotency skips the copy "
            "if this run committed",
            action,
            message.message_id,
            message.actor_name,
            channel,
        )
        return False

    def close(self) -> None:
        """Close the channel and the connection, the connection even when the channel is already gone.

        Dramatiq's ``close`` stops at the closed channel's error and leaves the connection (its
        socket and pika's wake-up socket pair) open: one leak per channel RabbitMQ closed.
        """
        try:
            super().close()  # type: ignore[no-untyped-call]
        finally:
            if self.connection.is_open:
                try:
                    self.connection.close()
                except (pika.exceptions.AMQPError, AssertionError):
                    logger.debug("closing a consumer connection failed", exc_info=True)
