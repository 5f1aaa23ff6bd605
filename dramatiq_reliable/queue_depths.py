"""Queue depths read from RabbitMQ: the one question ``status``, the gauges and the web page ask it.

Kept apart from :mod:`dramatiq_reliable.health` (which re-exports it) so the Postgres side of the
reading and the RabbitMQ side each have one home.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable
from typing import Any

from ._checks import check_ms
from ._tcp import bound_tcp
from ._util import rabbitmq_error
from .errors import ConfigurationError

__all__ = ["QueueDepths"]


class QueueDepths:
    """Reads queue depths with passive ``queue.declare`` on a connection of its own.

    A passive declare is the cheapest question RabbitMQ answers over AMQP: it changes nothing
    and returns the ready-message and consumer counts.  The connection is dedicated so a
    reading never shares a channel (or a lock) with the broker's publishers and consumers;
    it is opened on first use, reopened once after a drop, and is safe to use from several
    threads (one reading at a time).

    Parameters:
      parameters: pika connection parameters (or a list of them), e.g. ``broker.parameters``.
      rabbitmq_url: an AMQP URL instead of ``parameters`` (several separated by ``;``, as
        for the relay: the first that answers is read).
      timeout_ms: socket and connection timeout for a URL given here (whose connection also
        gets TCP keepalives and ``TCP_USER_TIMEOUT``, as ``OutboxBroker``'s; ``parameters``
        are used as they are, and a broker's already carry them).
    """

    def __init__(self, *, parameters: Any = None, rabbitmq_url: str | None = None, timeout_ms: int = 5000) -> None:
        import pika

        if (parameters is None) == (rabbitmq_url is None):
            raise ConfigurationError("pass exactly one of parameters= and rabbitmq_url= to QueueDepths")
        check_ms("timeout_ms", timeout_ms, minimum=1, fix="e.g. timeout_ms=5000")
        timeout_s = timeout_ms / 1000
        if rabbitmq_url is not None:
            parameters = [pika.URLParameters(url.strip()) for url in rabbitmq_url.split(";") if url.strip()]
            for item in parameters:
                item.socket_timeout = timeout_s
                item.stack_timeout = timeout_s
                item.blocked_connection_timeout = timeout_s
                item.connection_attempts = 1
            # A reading blocked on a silently partitioned server ends within about 11 s.
            parameters = bound_tcp(parameters[0] if len(parameters) == 1 else parameters)
        self._parameters = parameters
        self._connection: Any = None
        self._channel: Any = None
        self._lock = threading.Lock()

    def read(self, queues: Iterable[str]) -> dict[str, tuple[int, int] | None]:
        """``{queue: (ready messages, consumers)}``; ``None`` for a queue that does not exist.

        Raises ``pika.exceptions.AMQPConnectionError`` (or ``OSError``) when RabbitMQ cannot be
        reached, after one reconnect.
        """
        import pika.exceptions

        names = list(dict.fromkeys(queues))
        with self._lock:
            try:
                return self._read(names)
            except (pika.exceptions.AMQPConnectionError, pika.exceptions.ChannelWrongStateError, OSError):
                # An idle dedicated connection may have been dropped (heartbeats are only
                # answered while we call into pika): reconnect once before giving up.
                self._close()
                return self._read(names)

    def _read(self, names: list[str]) -> dict[str, tuple[int, int] | None]:
        import pika
        import pika.exceptions

        result: dict[str, tuple[int, int] | None] = {}
        # Connect even with no queues to read: reachability is part of the answer.
        if self._connection is None or not self._connection.is_open:
            self._connection = pika.BlockingConnection(self._parameters)
            self._channel = None
        for name in names:
            if self._channel is None or not self._channel.is_open:
                self._channel = self._connection.channel()
            try:
                frame = self._channel.queue_declare(queue=name, passive=True)
            except pika.exceptions.ChannelClosedByBroker as error:
                # 404: the queue does not exist (yet); RabbitMQ closed the channel.
                self._channel = None
                if error.reply_code != 404:
                    raise
                result[name] = None
                continue
            result[name] = (int(frame.method.message_count), int(frame.method.consumer_count))
        return result

    @property
    def parameters(self) -> Any:
        """The pika connection parameters this reader connects with (never print them: credentials)."""
        return self._parameters

    def describe(self, error: BaseException) -> str:
        """``cannot reach RabbitMQ at host:port: <reason>`` for an error of :meth:`read`."""
        return rabbitmq_error(error, self._parameters)

    def close(self) -> None:
        """Close the connection; the next :meth:`read` reopens it."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None:
            with contextlib.suppress(Exception):
                if connection.is_open:
                    connection.close()
