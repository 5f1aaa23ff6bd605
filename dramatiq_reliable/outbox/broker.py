"""OutboxBroker: ``actor.send()`` writes to the outbox table in the caller's transaction.

Producers get the transactional outbox; workers consume from RabbitMQ exactly as with
Dramatiq's ``RabbitmqBroker``, which this class extends.  The relay
(:mod:`dramatiq_reliable.outbox.relay`) moves committed rows to RabbitMQ.  The send path itself
(validation, which transaction, retries from a worker) is :mod:`dramatiq_reliable.sending`,
shared with ``PostgresBroker``.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, ClassVar

import psycopg
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.message import Message
from dramatiq.middleware import Middleware
from dramatiq.worker import ConsumerThread

from .. import _sql, schema
from ..backing import SendsTo
from ..database import DatabaseLike
from ..sending import DEFAULT_PAYLOAD_LIMIT_BYTES, Row, RowSending, TrackProcessing, Unbound

__all__ = ["OutboxBroker"]

logger = logging.getLogger("dramatiq_reliable.outbox")


class OutboxBroker(RowSending, RabbitmqBroker):
    """A RabbitMQ broker whose ``enqueue`` writes to a Postgres outbox instead of publishing.

    Where a message goes when it is sent:

    * inside :meth:`transaction` or :func:`~dramatiq_reliable.outbox.bind`: one row in the
      bound connection's transaction.  Commit and the message will be delivered; roll back and
      it never existed.
    * anywhere else (``on_unbound="autocommit"``, the default): one row inserted and committed
      on a pooled connection before ``send()`` returns, so an unbound send is durable too.  With
      ``on_unbound="error"`` such a send raises :class:`~dramatiq_reliable.errors.NotBound`
      instead, for apps that want every send tied to a transaction.  Sends Dramatiq makes inside
      a worker (retries, pipelines, callbacks) always use the outbox and are never refused:
      with RabbitMQ down they wait in Postgres instead of being acked away.
    * the move of a delayed message from its ``.DQ`` queue, which the worker's consumer thread
      makes when the eta passes, publishes straight to RabbitMQ with publisher confirms: the
      delayed message stays unacked until that publish is confirmed, so nothing is lost.

    Middleware see ``before_enqueue`` and ``after_enqueue`` around the outbox insert, and, if
    the insert fails, an ``after_enqueue_failed(broker, message, delay, *, exception)`` hook when
    they define one (Dramatiq has no such signal).

    The message is validated before anything is written (:func:`~dramatiq_reliable.sending.validate_send`):
    a bad one raises :class:`~dramatiq_reliable.errors.PayloadError` in the caller and the
    caller's transaction is untouched.  Payloads over ``max_payload_bytes`` are logged as a
    warning (payloads should carry IDs, not objects) and over ``payload_limit_bytes`` refused.

    Parameters:
      url: RabbitMQ URL, as for ``RabbitmqBroker``.
      database: where the outbox lives: a Postgres URL (the broker then creates its own pool),
        an existing ``psycopg_pool.ConnectionPool`` (the app's, shared and never closed by the
        broker) or a :class:`~dramatiq_reliable.Database`.
      schema: the Postgres schema holding the tables.
      on_unbound: ``"autocommit"`` or ``"error"``, see above.
      max_payload_bytes: encoded size above which a send logs a warning; ``None`` disables it.
      payload_limit_bytes: encoded size above which a send is refused with ``PayloadError``
        (default 16 MiB, RabbitMQ 4's ``max_message_size``); ``None`` disables it.
      worker_write_timeout_ms: how long a send made inside a worker (a retry, say) keeps
        trying while Postgres is unreachable before it raises.
      pool_max_size: connections in the pool the broker creates from a URL.  A
        transactional ``Idempotency`` job holds one for its whole run, so give it at least the
        worker's threads plus two (the relay and the dead letters); the worker warns otherwise.
      confirm_delivery: publisher confirms for the consumer thread's direct publishes.
      middleware, max_priority, parameters, **kwargs: as for ``RabbitmqBroker``.

    >>> broker = OutboxBroker(url="amqp://guest:guest@localhost:5672",
    ...                       database="postgresql://app@localhost/app")
    >>> dramatiq.set_broker(broker)                                       # doctest: +SKIP
    >>> with broker.transaction() as conn:                                # doctest: +SKIP
    ...     conn.execute("INSERT INTO orders (id) VALUES (%s)", (42,))
    ...     send_receipt.send(42)
    """

    sends_to: ClassVar[SendsTo] = "outbox"
    table: ClassVar[str] = "outbox"
    required_version: ClassVar[int] = schema.OUTBOX_VERSION

    def __init__(
        self,
        *,
        url: str | list[str] | None = None,
        database: DatabaseLike,
        schema: str = _sql.DEFAULT_SCHEMA,
        on_unbound: Unbound = "autocommit",
        max_payload_bytes: int | None = 64 * 1024,
        payload_limit_bytes: int | None = DEFAULT_PAYLOAD_LIMIT_BYTES,
        worker_write_timeout_ms: int = 30_000,
        pool_max_size: int = 10,
        confirm_delivery: bool = True,
        middleware: list[Middleware] | None = None,
        max_priority: int | None = None,
        parameters: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> None:
        self._init_sending(
            database=database,
            schema=schema,
            on_unbound=on_unbound,
            max_payload_bytes=max_payload_bytes,
            payload_limit_bytes=payload_limit_bytes,
            worker_write_timeout_ms=worker_write_timeout_ms,
            pool_max_size=pool_max_size,
        )
        super().__init__(
            confirm_delivery=confirm_delivery,
            url=url,
            middleware=middleware,
            max_priority=max_priority,
            parameters=parameters,
            **kwargs,
        )
        TrackProcessing.install(self)

    def close(self) -> None:
        """Close RabbitMQ connections and the pool this broker created."""
        super().close()
        self.database.close()

    # -- sending -----------------------------------------------------------------------------

    def enqueue(self, message: Message[Any], *, delay: int | None = None) -> Message[Any]:
        """Write ``message`` to the outbox (or publish it, for a consumer-thread delay move)."""
        if isinstance(threading.current_thread(), ConsumerThread):
            # The consumer thread moves a due message from .DQ to its queue; the source
            # message is acked only after this publish succeeds, so publishing directly is safe.
            return RabbitmqBroker.enqueue(self, message, delay=delay)
        return super().enqueue(message, delay=delay)

    def _insert(self, conn: psycopg.Connection[Any], row: Row) -> None:
        conn.execute(_sql.query("outbox_insert", self.schema), row)
