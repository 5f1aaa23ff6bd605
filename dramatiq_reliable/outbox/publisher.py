"""Pipelined publishing with publisher confirms: many messages in flight, one wait per batch.

pika's ``BlockingChannel`` with confirms waits a full round trip for every message, which caps
a relay at a few hundred messages a second.  This publisher turns on confirm mode on the
channel's underlying asynchronous channel, publishes a whole batch, then drives the connection
until RabbitMQ has acked or nacked every delivery tag, so a batch costs about one round trip.

Each message's frames (method, content header, body) are written to the socket together with
the frames of the messages around it, many messages per write: pika's ``basic_publish`` writes
each frame on its own, three system calls a message, which cost more than the rest of the
relay's per-message work.  The publish method frame is the same for every message to one
queue and is marshalled once by pika.  The content header carries the same three properties
for every message (persistent delivery, the message id, the priority), so it is packed here
directly rather than through pika's general property encoder, the largest per-message cost
left; ``tests/unit/test_publisher_frames.py`` checks it byte for byte against pika's.

Queues are declared through a middleware-free ``RabbitmqBroker`` with the workers'
:class:`~dramatiq_reliable.outbox.queues.QueueSettings`, so they get exactly the arguments the
workers declare (dead-letter routing to ``.XQ``, the delay queue, priority, quorum type).

Outcomes are per message: confirmed, or failed with a reason (nacked, unroutable, refused by a
channel error).  A connection-level failure raises :class:`BrokerUnavailable` instead: then
nothing can be said about any message and the caller should keep every row for later.
"""

from __future__ import annotations

import dataclasses
import logging
import struct
import time
from collections.abc import Sequence
from typing import Any

import pika
import pika.exceptions
import pika.frame
import pika.spec
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.common import q_name
from dramatiq.errors import BrokerConnectionError

from .._checks import check_int, check_ms
from .._util import rabbitmq_error, rabbitmq_reason
from ..errors import BrokerUnavailable, ReliableError
from .nodes import SpreadsOverNodes
from .queues import DeclaresQueues, QueueSettings

__all__ = []

logger = logging.getLogger("dramatiq_reliable.outbox.publisher")

# Write (and flush) every so many publishes so frames go out while we keep encoding.
_FLUSH_EVERY = 128
# Publish method frames kept per routing key; cleared past this many keys.
_METHOD_FRAME_CACHE = 1024

# AMQP 0-9-1 framing (section 4.2.3): type, channel, payload size, payload, frame end.  A
# content header's payload is the class id, a zero weight, the body size, the property flags
# and the properties in flag order.
_HEADER = struct.Struct(">BHIHxxQH")
_HEADER_PAYLOAD_FIXED = 14  # class id, weight, body size, flags
_BODY = struct.Struct(">BHI")
_FRAME_END = bytes((pika.spec.FRAME_END,))
_PERSISTENT = 2
_FLAGS = pika.spec.BasicProperties.FLAG_DELIVERY_MODE | pika.spec.BasicProperties.FLAG_MESSAGE_ID
_FLAGS_PRIORITY = _FLAGS | pika.spec.BasicProperties.FLAG_PRIORITY


@dataclasses.dataclass(frozen=True)
class Publication:
    """One message to publish.  ``key`` is the caller's handle for it (an outbox row id)."""

    key: int
    routing_key: str
    body: bytes
    message_id: str
    priority: int | None = None


@dataclasses.dataclass
class PublishOutcome:
    """What RabbitMQ said about each publication of a batch."""

    confirmed: list[int] = dataclasses.field(default_factory=list)
    failed: dict[int, str] = dataclasses.field(default_factory=dict)
    #: Set when the connection failed after RabbitMQ had already confirmed (or refused) some
    #: publications: those outcomes are kept, every other key has none (publish it again).
    unavailable: BrokerUnavailable | None = None
    #: The failed keys whose confirm did not come within the timeout (a subset of ``failed``).
    timed_out: set[int] = dataclasses.field(default_factory=set)


def bounded(parameters: Any, *, blocked_timeout_s: float) -> Any:
    """``parameters`` (one ``pika.ConnectionParameters`` or a list) with the blocked wait bounded.

    A connection RabbitMQ blocks (a memory or disk alarm) is dropped after ``blocked_timeout_s``
    instead of holding the relay forever, unless the URL sets ``blocked_connection_timeout``.
    pika already bounds the connect (``socket_timeout`` 10 s, ``stack_timeout`` 15 s), and a
    silent partition during a publish ends at the confirm timeout.  The heartbeat is left to the
    URL and the server (60 s): the relay does not service a heartbeat while it waits for rows, so a
    shorter one would only drop idle connections.
    """
    for item in parameters if isinstance(parameters, list) else [parameters]:
        if item.blocked_connection_timeout is None:
            item.blocked_connection_timeout = blocked_timeout_s
    return parameters


class _Declarer(SpreadsOverNodes, DeclaresQueues, RabbitmqBroker):
    """A middleware-free broker that only declares queues, as the workers do."""

    def __init__(self, queues: QueueSettings) -> None:
        self.queue_settings = queues
        super().__init__(middleware=[], max_priority=queues.max_priority)


class Publisher:
    """Publishes batches to RabbitMQ with pipelined confirms.  Not thread-safe: one per relay thread."""

    def __init__(
        self,
        parameters: Any,
        *,
        max_priority: int | None = None,
        confirm_timeout_ms: int = 30_000,
        queues: QueueSettings | None = None,
    ) -> None:
        check_int("max_priority", max_priority, minimum=1, maximum=255, allow_none=True)
        check_ms("confirm_timeout_ms", confirm_timeout_ms, minimum=1)
        self._declarer = _Declarer(queues if queues is not None else QueueSettings(max_priority=max_priority))
        self._confirm_timeout_s = confirm_timeout_ms / 1000
        self._declarer.parameters = bounded(parameters, blocked_timeout_s=self._confirm_timeout_s)
        self._channel: Any = None  # pika.channel.Channel (the asynchronous one) in confirm mode
        self._blocking_channel: Any = None
        self._next_tag = 0
        self._pending: dict[int, Publication] = {}
        self._returned: dict[str, str] = {}
        self._outcome = PublishOutcome()
        self._method_frames: dict[str, bytes] = {}

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        """Close the channel and connection; the next publish reconnects."""
        self._reset()
        self._declarer.close()

    def _reset(self) -> None:
        self._channel = None
        if self._blocking_channel is not None:
            try:
                if self._blocking_channel.is_open:
                    self._blocking_channel.close()
            except Exception:  # pragma: no cover - closing a broken channel
                logger.debug("error closing the publish channel", exc_info=True)
            self._blocking_channel = None
        try:
            del self._declarer.connection
        except Exception:  # pragma: no cover - closing a broken connection
            logger.debug("error closing the publish connection", exc_info=True)
        # After a reconnect (maybe to a reset server), declare every queue again.
        self._declarer.queues_pending |= self._declarer.queues

    def _open_channel(self) -> Any:
        if self._channel is not None and self._channel.is_open:
            return self._channel
        self._blocking_channel = None
        try:
            connection = self._declarer.connection
            blocking = connection.channel()
            channel = blocking._impl
            selected: list[bool] = []
            channel.confirm_delivery(self._on_confirm, callback=lambda _frame: selected.append(True))
            channel.add_on_return_callback(self._on_return)
            self._wait(connection, lambda: bool(selected) or channel.is_closed)
            if not selected:
                raise BrokerUnavailable("RabbitMQ closed the channel while enabling publisher confirms")
        except (pika.exceptions.AMQPError, OSError) as error:
            self._reset()
            raise BrokerUnavailable(f"cannot open a RabbitMQ channel: {rabbitmq_reason(error)}") from error
        self._blocking_channel = blocking
        self._channel = channel
        self._next_tag = 0
        self._method_frames = {}  # they carry the channel number
        return channel

    # -- publishing ------------------------------------------------------------------------

    def publish(self, publications: Sequence[Publication]) -> PublishOutcome:
        """Publish ``publications`` and wait for RabbitMQ to confirm each one.

        Raises ``BrokerUnavailable`` when the connection fails; otherwise every key is in
        ``confirmed`` or ``failed`` of the returned outcome.
        """
        outcome = PublishOutcome()
        try:
            ready = self._declare_queues(publications, outcome)
            unresolved = self._publish_pipelined(ready, outcome) if ready else []
            # A channel error refused some message of the batch without saying which: publish the
            # unresolved ones one at a time so only the culprit is marked failed.
            for publication in unresolved:
                if self._publish_pipelined([publication], outcome):
                    outcome.failed[publication.key] = self._last_channel_error or "channel closed by RabbitMQ"
        except BrokerUnavailable as error:
            if not outcome.confirmed and not outcome.failed:
                raise
            # What RabbitMQ confirmed before the connection went is confirmed: keep it, so the
            # caller marks those rows instead of publishing them again.
            outcome.unavailable = error
        return outcome

    _last_channel_error: str | None = None

    def _declare_queues(self, publications: Sequence[Publication], outcome: PublishOutcome) -> list[Publication]:
        by_queue: dict[str, list[Publication]] = {}
        for publication in publications:
            by_queue.setdefault(q_name(publication.routing_key), []).append(publication)
        ready: list[Publication] = []
        for queue_name, members in by_queue.items():
            if not queue_name.strip():
                # RabbitMQ would name (and keep) a new queue for an empty name on every try.
                for publication in members:
                    outcome.failed[publication.key] = (
                        f"the queue name {publication.routing_key!r} is empty; nothing was declared or published "
                        "(fix or delete the row)"
                    )
                continue
            try:
                self._declarer.declare_queue(queue_name, ensure=True)
            except Exception as error:
                if isinstance(error, BrokerConnectionError):
                    self._channel = None
                    self._check_connection(error)
                # The server is reachable, so this queue itself is the problem.
                shown = error if isinstance(error, ReliableError) else (error.__context__ or error)
                reason = f"cannot declare queue {queue_name!r}: {_describe(shown)}"
                for publication in members:
                    outcome.failed[publication.key] = reason
                continue
            ready.extend(members)
        return ready

    def _check_connection(self, cause: BaseException) -> None:
        try:
            self._declarer.channel  # noqa: B018 - opens a connection and channel if possible
        except (pika.exceptions.AMQPError, OSError, BrokerConnectionError) as error:
            self._reset()
            raise BrokerUnavailable(rabbitmq_error(error, self._declarer.parameters)) from cause

    def _publish_pipelined(self, publications: Sequence[Publication], outcome: PublishOutcome) -> list[Publication]:
        """Publish and wait; return the publications left without an outcome by a channel error."""
        channel = self._open_channel()
        connection = self._declarer.connection
        self._pending = {}
        self._returned = {}
        self._outcome = outcome
        self._last_channel_error = None
        write = _frame_writer(channel)
        try:
            chunk: list[bytes] = []
            for index, publication in enumerate(publications, 1):
                if not channel.is_open:
                    break
                try:
                    if write is None:
                        self._basic_publish(channel, publication)
                    else:
                        chunk.append(self._frames(channel, publication))
                except (ValueError, TypeError, struct.error, pika.exceptions.ShortStringTooLong) as error:
                    # Frames are marshalled before any is written, so a value that cannot be
                    # encoded (a routing key over 255 bytes, a priority over 255) fails alone.
                    outcome.failed[publication.key] = f"cannot publish: {_describe(error)}"
                    continue
                self._next_tag += 1
                self._pending[self._next_tag] = publication
                if index % _FLUSH_EVERY == 0:
                    if chunk and write is not None:
                        write(b"".join(chunk))
                        chunk = []
                    connection.process_data_events(0)
            if chunk and write is not None and channel.is_open:
                write(b"".join(chunk))
            deadline = time.monotonic() + self._confirm_timeout_s
            self._wait(
                connection,
                lambda: not self._pending or channel.is_closed or time.monotonic() >= deadline,
                deadline=deadline,
            )
        except (pika.exceptions.ChannelClosed, pika.exceptions.ChannelWrongStateError):
            pass  # handled below as a channel error
        except (pika.exceptions.AMQPError, OSError) as error:
            self._reset()
            raise BrokerUnavailable(
                f"lost the RabbitMQ connection while publishing: {rabbitmq_reason(error)}"
            ) from error
        if channel.is_closed:
            reason = getattr(channel, "_closing_reason", None)
            self._last_channel_error = (
                f"RabbitMQ closed the channel: {_describe(reason) if reason else 'unknown reason'}"
            )
            self._channel = None
            unresolved = [p for p in publications if p.key not in outcome.failed and p.key not in outcome.confirmed]
            self._pending = {}
            return unresolved
        if self._pending:
            # The confirms did not all come in time.  What was confirmed stays confirmed (the
            # callbacks recorded it).  A fresh connection tells a slow link or an oversized
            # message (RabbitMQ reachable: count an attempt against each unconfirmed row, so
            # it backs off and the others go through) from an outage (nothing is counted).
            unconfirmed = list(self._pending.values())
            self._pending = {}
            self._reset()
            self._check_connection(
                BrokerUnavailable(f"RabbitMQ did not confirm {len(unconfirmed)} messages in {self._confirm_timeout_s}s")
            )
            for publication in unconfirmed:
                outcome.timed_out.add(publication.key)
                outcome.failed[publication.key] = (
                    f"RabbitMQ did not confirm the message ({len(publication.body):,} bytes) within "
                    f"confirm_timeout_ms={round(self._confirm_timeout_s * 1000)}: a slow link or an oversized "
                    "message; retried with backoff (RabbitMQ may hold a copy)"
                )
        return []

    def _frames(self, channel: Any, publication: Publication) -> bytes:
        """The marshalled frames of one publish: method, content header and body frames."""
        number = channel.channel_number
        method = self._method_frames.get(publication.routing_key)
        if method is None:
            if len(self._method_frames) >= _METHOD_FRAME_CACHE:
                self._method_frames.clear()
            method = pika.frame.Method(
                number, pika.spec.Basic.Publish(exchange="", routing_key=publication.routing_key, mandatory=True)
            ).marshal()
            self._method_frames[publication.routing_key] = method
        body = publication.body
        parts = [method, _header_frame(number, len(body), publication.message_id, publication.priority)]
        # A body longer than the negotiated frame size goes in several body frames, as pika
        # would send it.
        limit = channel.connection._body_max_length
        for offset in range(0, len(body), limit):
            chunk = body[offset : offset + limit]
            parts += (_BODY.pack(pika.spec.FRAME_BODY, number, len(chunk)), chunk, _FRAME_END)
        return b"".join(parts)

    @staticmethod
    def _basic_publish(channel: Any, publication: Publication) -> None:
        channel.basic_publish(
            exchange="",
            routing_key=publication.routing_key,
            body=publication.body,
            properties=pika.BasicProperties(
                delivery_mode=2, priority=publication.priority, message_id=publication.message_id
            ),
            mandatory=True,
        )

    def _wait(self, connection: Any, done: Any, *, deadline: float | None = None) -> None:
        deadline = deadline if deadline is not None else time.monotonic() + self._confirm_timeout_s
        # A timer makes the I/O loop wake at the deadline even if RabbitMQ stays silent.
        timer = connection.call_later(max(0.0, deadline - time.monotonic()), lambda: None)
        try:
            # _flush_output drives pika's I/O loop until done() holds: confirms are dispatched
            # to our callbacks as frames arrive, with no polling interval added to latency.
            connection._flush_output(lambda: done() or time.monotonic() >= deadline)
        finally:
            if connection.is_open:
                connection.remove_timeout(timer)

    # -- callbacks from pika's I/O loop ----------------------------------------------------

    def _on_confirm(self, frame: Any) -> None:
        method = frame.method
        tag = method.delivery_tag
        tags = [t for t in self._pending if t <= tag] if method.multiple else [tag]
        acked = isinstance(method, pika.spec.Basic.Ack)
        for t in tags:
            publication = self._pending.pop(t, None)
            if publication is None:
                continue
            returned = self._returned.pop(publication.message_id, None)
            if acked and returned is None:
                self._outcome.confirmed.append(publication.key)
            else:
                self._outcome.failed[publication.key] = returned or "RabbitMQ nacked the message"
                if returned is not None:
                    # The queue vanished after we declared it: declare it again next time.
                    self._declarer.queues_pending.add(q_name(publication.routing_key))

    def _on_return(self, _channel: Any, method: Any, properties: Any, _body: bytes) -> None:
        self._returned[properties.message_id] = (
            f"unroutable: RabbitMQ returned the message ({method.reply_code} {method.reply_text}) "
            f"for routing key {method.routing_key!r}"
        )


def _header_frame(channel_number: int, body_size: int, message_id: str, priority: int | None) -> bytes:
    """The content header frame pika marshals for ``BasicProperties(delivery_mode=2, priority=...,
    message_id=...)``, byte for byte, and failing as it does: ``ShortStringTooLong`` for a
    message id over 255 bytes, ``struct.error`` for a priority outside 0-255."""
    encoded = message_id.encode()
    if len(encoded) > 255:
        raise pika.exceptions.ShortStringTooLong(encoded)
    if priority is None:
        flags, properties = _FLAGS, bytes((_PERSISTENT, len(encoded))) + encoded
    else:
        flags, properties = _FLAGS_PRIORITY, struct.pack("BBB", _PERSISTENT, priority, len(encoded)) + encoded
    size = _HEADER_PAYLOAD_FIXED + len(properties)
    prefix = _HEADER.pack(pika.spec.FRAME_HEADER, channel_number, size, pika.spec.Basic.INDEX, body_size, flags)
    return prefix + properties + _FRAME_END


def _frame_writer(channel: Any) -> Any:
    """A function writing marshalled frames to ``channel``'s connection, or ``None``.

    pika has no public call for this; the connection's frame output (the one ``basic_publish``
    ends in, which also counts the bytes and frames sent) is used when this pika has it, else
    the publisher falls back to one ``basic_publish`` a message.
    """
    connection = getattr(channel, "connection", None)
    output = getattr(connection, "_output_marshaled_frames", None)
    if output is None or not isinstance(getattr(connection, "_body_max_length", None), int):
        return None
    return lambda data: output([data])


def _describe(error: object) -> str:
    text = str(error) or repr(error)
    return f"{type(error).__name__}: {text}" if isinstance(error, BaseException) else text
