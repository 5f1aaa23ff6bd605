"""OutboxBroker: ``actor.send()`` writes to the outbox table in the caller's transaction.

Producers get the transactional outbox; workers consume from RabbitMQ exactly as with
Dramatiq's ``RabbitmqBroker``, which this class extends.  The relay
(:mod:`dramatiq_reliable.outbox.relay`) moves committed rows to RabbitMQ.  The send path itself
(validation, which transaction, retries from a worker) is :mod:`dramatiq_reliable.sending`,
shared with ``PostgresBroker``.

``join()`` and ``flush()`` see the outbox too: a message sent is in the queue from the moment
its row commits, whether or not a relay has published it yet, so a test's ``broker.join(queue)``
waits for the relay and ``broker.flush_all()`` leaves no row to be published after it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, ClassVar

import psycopg
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.common import dq_name, q_name
from dramatiq.message import Message
from dramatiq.middleware import Middleware
from dramatiq.worker import ConsumerThread
from psycopg.rows import dict_row

from .. import _sql, schema
from .._checks import check_ms
from .._tcp import DEFAULT_TCP_USER_TIMEOUT_MS, bound_tcp, check_tcp_user_timeout_ms
from ..backing import SendsTo
from ..database import DatabaseLike
from ..dedupe import DedupeOptions
from ..errors import PayloadError, SchemaNotReady
from ..joining import join_until_empty
from ..sending import DEFAULT_PAYLOAD_LIMIT_BYTES, Row, RowSending, TrackProcessing, Unbound
from .delivery_limit import LimitedConsumer
from .long_jobs import DEFAULT_CONSUMER_TIMEOUT_MS, warn_if_too_long
from .nodes import SpreadsOverNodes
from .queues import DeclaresQueues, QueueSettings, QueueType

__all__ = ["OutboxBroker"]

logger = logging.getLogger("dramatiq_reliable.outbox")


class OutboxBroker(SpreadsOverNodes, DeclaresQueues, RowSending, RabbitmqBroker):
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
    * a delayed send (``delay=``, a retry's backoff, a replay with a delay) is a row like any
      other, addressed to the queue itself and due at its eta: it waits in Postgres, and the
      relay publishes it when due, so no worker holds it unacked for its delay (RabbitMQ's
      ``consumer_timeout`` would close the channel under it) and worker memory does not grow
      with delays.
    * only messages already in a ``.DQ`` queue from an older version (or from a plain
      ``RabbitmqBroker``) still take Dramatiq's way: the worker's consumer thread moves each
      to its queue when its eta passes, publishing straight to RabbitMQ with publisher
      confirms, and the delayed message stays unacked until that publish is confirmed.

    Middleware see ``before_enqueue`` and ``after_enqueue`` around the outbox insert, and, if
    the insert fails, an ``after_enqueue_failed(broker, message, delay, *, exception)`` hook when
    they define one (Dramatiq has no such signal).

    The message is validated before anything is written (:func:`~dramatiq_reliable.sending.validate_send`):
    a bad one raises :class:`~dramatiq_reliable.errors.PayloadError` in the caller and the
    caller's transaction is untouched.  Payloads over ``max_payload_bytes`` are logged as a
    warning (payloads should carry IDs, not objects) and over ``payload_limit_bytes`` refused.

    Parameters:
      url: RabbitMQ URL, as for ``RabbitmqBroker``; several nodes of a cluster as a list or
        ``;``-separated: each connection starts at a random one and fails over to the others.
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
      tcp_user_timeout_ms: how long the kernel lets a RabbitMQ connection of this broker (the
        workers' consumers, its publishes, a relay built with ``Relay.from_broker``) go without
        an answer before dropping it: TCP keepalives and ``TCP_USER_TIMEOUT``, so a silent
        partition (packets dropped, no RST) ends in about 11 s instead of the heartbeat's 65-130 s.
        A URL's ``?tcp_options=...`` wins; ``None`` sets nothing.
      consumer_timeout_ms: the RabbitMQ server's ``consumer_timeout`` (30 minutes by default).
        An actor whose ``time_limit`` exceeds it runs under a Postgres lease when the broker has
        the :class:`~dramatiq_reliable.outbox.LongJobs` middleware, and logs a warning when it
        is declared otherwise (see :mod:`~dramatiq_reliable.outbox.long_jobs`).
      queue_type: ``"classic"`` (Dramatiq's queues, the default) or ``"quorum"``: replicated
        queues that survive the loss of a cluster node (docs/production-topology.md).  The
        queue, its ``.DQ`` and its ``.XQ`` are declared with that type; relays built with
        :meth:`Relay.from_broker` declare them the same way.  A queue that already exists with
        the other type raises :class:`~dramatiq_reliable.errors.QueueMismatch`, which says how
        to move it.  Quorum queues have no priorities on RabbitMQ 3.x: ``max_priority`` is
        refused with them, and so is a send with ``broker_priority`` to one.
      queue_types: per queue overrides of ``queue_type``, e.g. ``{"emails": "quorum"}``.
      delivery_limit: on quorum queues, a message delivered this many times without an ack (each
        time the worker died holding it) is stored as a dead letter (reason ``delivery_limit``)
        instead of running again; RabbitMQ's own ``x-delivery-limit`` is set a few above it as a
        backstop.  ``None`` removes both: a message that kills its worker then comes back forever.
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
    insert_query: ClassVar[str] = "outbox_insert"
    insert_dedupe_query: ClassVar[str] = "outbox_insert_dedupe"

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
        tcp_user_timeout_ms: int | None = DEFAULT_TCP_USER_TIMEOUT_MS,
        consumer_timeout_ms: int = DEFAULT_CONSUMER_TIMEOUT_MS,
        queue_type: QueueType = "classic",
        queue_types: Mapping[str, QueueType] | None = None,
        delivery_limit: int | None = 20,
        middleware: list[Middleware] | None = None,
        max_priority: int | None = None,
        parameters: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> None:
        check_tcp_user_timeout_ms(tcp_user_timeout_ms)
        self.queue_settings = QueueSettings(
            queue_type=queue_type,
            queue_types=dict(queue_types or {}),
            max_priority=max_priority,
            delivery_limit=delivery_limit,
        )
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
        # Dramatiq's consumers connect with these parameters too, so this bounds the workers.
        bound_tcp(self.parameters, tcp_user_timeout_ms=tcp_user_timeout_ms)
        self.consumer_timeout_ms = check_ms("consumer_timeout_ms", consumer_timeout_ms, minimum=1)
        DedupeOptions.install(self)
        TrackProcessing.install(self)

    def declare_actor(self, actor: Any) -> None:
        super().declare_actor(actor)
        warn_if_too_long(self, actor, consumer_timeout_ms=self.consumer_timeout_ms)

    def close(self) -> None:
        """Close RabbitMQ connections and the pool this broker created."""
        super().close()
        self.database.close()

    @property
    def consumer_class(self) -> type[LimitedConsumer]:
        """Acks and nacks only on the delivering channel (:mod:`.consumer`), and the delivery limit
        applied on quorum queues (:mod:`.delivery_limit`)."""
        return LimitedConsumer

    # -- sending -----------------------------------------------------------------------------

    def enqueue(self, message: Message[Any], *, delay: int | None = None) -> Message[Any]:
        """Write ``message`` to the outbox (or publish it, for a consumer-thread delay move)."""
        if isinstance(threading.current_thread(), ConsumerThread):
            # The consumer thread moves a due message from .DQ to its queue (only legacy .DQ
            # messages: our own delays wait in the outbox); the source message is acked only
            # after this publish succeeds, so publishing directly is safe.
            return RabbitmqBroker.enqueue(self, message, delay=delay)
        return super().enqueue(message, delay=delay)

    def _check_message(self, message: Message[Any]) -> None:
        """RabbitMQ 3.x quorum queues ignore a priority: refuse it rather than reorder nothing (sync and async sends)."""
        priority = message.options.get("broker_priority")
        if priority is not None and self.queue_settings.type_of(message.queue_name) == "quorum":
            raise PayloadError(
                f"message to actor {message.actor_name!r} has broker_priority={priority!r} but queue "
                f"{q_name(message.queue_name)!r} is a quorum queue, which has no priorities on RabbitMQ 3.x; "
                "drop broker_priority, or give urgent work its own queue (queue_types={'urgent': 'quorum'})"
            )

    def _row(self, message: Message[Any], canonical: str, body: bytes) -> Row:
        """A delayed message's row goes to the queue itself, due at its eta, with no eta in its body.

        Dramatiq would publish it to ``.DQ`` with an ``eta``, where a worker's consumer takes
        it into memory, unacked until the eta: RabbitMQ's ``consumer_timeout`` then closes the
        channel under it, redelivering everything the channel held, and worker memory grows
        with every delay.  Here the row waits in Postgres instead (``available_at`` is its due
        time, see ``outbox_insert.sql``) and the relay publishes it when due, to the queue the
        workers run at once.  The message returned by ``send()`` and seen by the enqueue hooks
        keeps Dramatiq's ``.DQ`` name and ``eta``.
        """
        row = super()._row(message, canonical, body)
        if row["eta_ms"] is None:
            return row
        due = message.copy(queue_name=canonical)  # options copied: deleting below leaves the caller's
        del due.options["eta"]
        row["queue_name"] = canonical
        row["body"] = self.encode(due, warn=False)
        return row

    # -- tests' helpers: join and flush ----------------------------------------------------------

    def join(
        self, queue_name: str, min_successes: int = 10, idle_time: int = 100, *, timeout: int | None = None
    ) -> None:
        """Wait until every message sent to ``queue_name`` was published and consumed.

        ``RabbitmqBroker.join``'s contract, counting the outbox too: every ``idle_time``
        milliseconds the queue's unpublished outbox rows (its delayed ones included) and the
        messages in RabbitMQ's queue and delay queue are counted, and the total must be 0
        ``min_successes`` times in a row.  Raises ``QueueJoinTimeout`` after ``timeout``
        milliseconds, e.g. when no relay runs.  As with RabbitMQ, a message a worker holds
        unacked is not counted.
        """
        canonical = q_name(queue_name)
        names = [canonical, dq_name(canonical)]

        def pending() -> int:
            with self._outbox() as conn:
                cursor = conn.cursor(row_factory=dict_row)
                row = cursor.execute(_sql.query("outbox_pending", self.schema), {"queue_names": names}).fetchone()
            unpublished = int(row["pending"]) if row else 0
            if unpublished:
                return unpublished  # RabbitMQ is asked only once the relay has published them all
            ready, delayed, _dead = self.get_queue_message_counts(canonical)
            return int(ready) + int(delayed)

        join_until_empty(
            canonical,
            pending,
            min_successes=min_successes,
            idle_time=idle_time,
            timeout=timeout,
            sleep=self.connection.sleep,
        )

    def flush(self, queue_name: str) -> None:
        """Drop every message of ``queue_name``: its unpublished outbox rows, then RabbitMQ's queues.

        Rows already published stay in the outbox for audit (retention purges them).
        """
        self._flush_outbox([queue_name])
        super().flush(queue_name)

    def flush_all(self) -> None:
        """Drop every message of every declared queue, unpublished outbox rows included."""
        self._flush_outbox(self.queues)
        for queue_name in self.queues:
            super().flush(queue_name)

    def _flush_outbox(self, queue_names: Iterable[str]) -> None:
        # Before RabbitMQ's purge: a row a relay is publishing meanwhile is then purged there.
        names = [name for queue_name in queue_names for name in (q_name(queue_name), dq_name(q_name(queue_name)))]
        if names:
            with self._outbox() as conn:
                conn.execute(_sql.query("outbox_flush", self.schema), {"queue_names": names})

    @contextlib.contextmanager
    def _outbox(self) -> Iterator[psycopg.Connection[Any]]:
        """A pooled autocommit connection whose statements raise ``SchemaNotReady`` on an unmigrated schema."""
        with self.database.autocommit() as conn:
            try:
                yield conn
            except psycopg.errors.UndefinedTable as error:
                raise SchemaNotReady(
                    f"table {self.schema!r}.{self.table!r} does not exist; run {schema.migrate_command(self.schema)!r}"
                ) from error
