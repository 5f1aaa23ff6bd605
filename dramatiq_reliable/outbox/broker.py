"""OutboxBroker: ``actor.send()`` writes to the outbox table in the caller's transaction.

Producers get the transactional outbox; workers consume from RabbitMQ exactly as with
Dramatiq's ``RabbitmqBroker``, which this class extends.  The relay
(:mod:`dramatiq_reliable.outbox.relay`) moves committed rows to RabbitMQ.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any, Literal

import psycopg
from dramatiq.broker import Broker, MessageProxy
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.common import current_millis, dq_name
from dramatiq.message import Message
from dramatiq.middleware import Middleware
from dramatiq.worker import ConsumerThread, WorkerThread
from psycopg_pool import PoolTimeout

from .. import _sql, schema
from ..database import Database, DatabaseLike
from ..errors import ConfigurationError, NotBound, OutboxWriteError, PayloadError, SchemaNotReady
from .binding import bound_connection, bound_transaction

__all__ = ["OutboxBroker"]

logger = logging.getLogger("dramatiq_reliable.outbox")


Unbound = Literal["autocommit", "error"]


class OutboxBroker(RabbitmqBroker):
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

    The encoded message is validated before anything is written: a payload that cannot be
    encoded raises :class:`~dramatiq_reliable.errors.PayloadError` in the caller and the
    caller's transaction is untouched.  Payloads over ``max_payload_bytes`` are logged as a
    warning (payloads should carry IDs, not objects).

    Parameters:
      url: RabbitMQ URL, as for ``RabbitmqBroker``.
      database: where the outbox lives: a Postgres URL (the broker then creates its own pool),
        an existing ``psycopg_pool.ConnectionPool`` (the app's, shared and never closed by the
        broker) or a :class:`~dramatiq_reliable.Database`.
      schema: the Postgres schema holding the tables.
      on_unbound: ``"autocommit"`` or ``"error"``, see above.
      max_payload_bytes: encoded size above which a send logs a warning; ``None`` disables it.
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

    def __init__(
        self,
        *,
        url: str | list[str] | None = None,
        database: DatabaseLike,
        schema: str = _sql.DEFAULT_SCHEMA,
        on_unbound: Unbound = "autocommit",
        max_payload_bytes: int | None = 64 * 1024,
        worker_write_timeout_ms: int = 30_000,
        pool_max_size: int = 10,
        confirm_delivery: bool = True,
        middleware: list[Middleware] | None = None,
        max_priority: int | None = None,
        parameters: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> None:
        if on_unbound not in ("autocommit", "error"):
            raise ConfigurationError(f"on_unbound must be 'autocommit' or 'error', got {on_unbound!r}")
        if max_payload_bytes is not None and (not isinstance(max_payload_bytes, int) or max_payload_bytes <= 0):
            raise ConfigurationError(f"max_payload_bytes must be a positive int or None, got {max_payload_bytes!r}")
        self.schema = _sql.validate_schema(schema)
        self.database = Database.of(database, max_size=pool_max_size)
        self.on_unbound: Unbound = on_unbound
        self.max_payload_bytes = max_payload_bytes
        if (
            isinstance(worker_write_timeout_ms, bool)
            or not isinstance(worker_write_timeout_ms, int)
            or worker_write_timeout_ms < 0
        ):
            raise ConfigurationError(
                f"worker_write_timeout_ms must be a non-negative int, got {worker_write_timeout_ms!r}"
            )
        self.worker_write_timeout_ms = worker_write_timeout_ms
        self._checked_schema = False
        self._check_lock = threading.Lock()
        super().__init__(
            confirm_delivery=confirm_delivery,
            url=url,
            middleware=middleware,
            max_priority=max_priority,
            parameters=parameters,
            **kwargs,
        )
        # First in the list, so its after-hooks run last: the message stays known while the
        # other middleware (Retries above all) enqueue from their after-hooks.
        tracker = _TrackProcessing()
        if self.middleware:
            self.add_middleware(tracker, before=type(self.middleware[0]))
        else:
            self.add_middleware(tracker)

    # -- binding -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def transaction(self) -> Iterator[psycopg.Connection[Any]]:
        """Open a pooled connection and transaction, and bind it for ``send()``.

        The transaction commits when the block exits normally and rolls back when it raises;
        do your own writes on the yielded connection so they commit with the messages.
        """
        with bound_transaction(self.database) as conn:
            yield conn

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
            return super().enqueue(message, delay=delay)

        if delay is not None and (isinstance(delay, bool) or not isinstance(delay, int) or delay < 0):
            raise ConfigurationError(f"delay must be a non-negative int of milliseconds, got {delay!r}")
        canonical_queue_name = message.queue_name
        if delay is not None:
            message = message.copy(queue_name=dq_name(canonical_queue_name), options={"eta": current_millis() + delay})
        # Validate before any middleware sees the message: a bad payload has no side effect.
        self._validate_priority(message)
        self._encode(message)
        # Registers the queue (no network) so a worker sharing this broker consumes it.
        self.declare_queue(canonical_queue_name)
        try:
            self.emit_before("enqueue", message, delay)
            # Encoded again: before_enqueue hooks may have added options (trace context).
            self._insert(message, self._encode(message, warn=False))
        except BaseException as error:
            self._emit_enqueue_failed(message, delay, error)
            raise
        self.emit_after("enqueue", message, delay)
        return message

    @staticmethod
    def _validate_priority(message: Message[Any]) -> None:
        priority = message.options.get("broker_priority")
        if priority is not None and (
            isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= 255
        ):
            raise PayloadError(
                f"message {message.message_id!r} for actor {message.actor_name!r} has broker_priority={priority!r}; "
                "RabbitMQ priorities are ints from 0 to 255 (and queues need max_priority= on the broker)"
            )

    def _emit_enqueue_failed(self, message: Message[Any], delay: int | None, error: BaseException) -> None:
        # Dramatiq has no signal for a failed enqueue; middleware that opened something in
        # before_enqueue (a span) may define after_enqueue_failed to close it.
        for middleware in reversed(self.middleware):
            hook = getattr(middleware, "after_enqueue_failed", None)
            if hook is None:
                continue
            try:
                hook(self, message, delay, exception=error)
            except Exception:
                logger.exception("after_enqueue_failed of %r failed", middleware)

    def _encode(self, message: Message[Any], *, warn: bool = True) -> bytes:
        try:
            body = message.encode()
        except Exception as error:
            raise PayloadError(
                f"message {message.message_id!r} for actor {message.actor_name!r} cannot be encoded: {error}; "
                "send only JSON-serialisable arguments (IDs, strings, numbers), not objects"
            ) from error
        if warn and self.max_payload_bytes is not None and len(body) > self.max_payload_bytes:
            logger.warning(
                "message %s for actor %r is %d bytes, over max_payload_bytes=%d; payloads should carry IDs, "
                "not objects (load the record in the actor)",
                message.message_id,
                message.actor_name,
                len(body),
                self.max_payload_bytes,
            )
        return body

    def _insert(self, message: Message[Any], body: bytes) -> None:
        params = (
            message.message_id,
            message.queue_name,
            message.actor_name,
            body,
            message.options.get("broker_priority"),
            message.options.get("eta"),
        )
        conn = bound_connection()
        if conn is not None:
            self._execute(conn, params)
            return
        if self.on_unbound == "error" and not _in_worker_thread():
            raise NotBound(
                f"send() of actor {message.actor_name!r} outside a transaction; wrap it in "
                "'with broker.transaction():' or 'with bind(conn):', or build the broker with on_unbound='autocommit'"
            )
        # Autocommit on a pooled connection.  A failure during COMMIT may leave the row
        # written: the retry then adds a second row with the same message_id, which consumers
        # dedupe (at least once, never zero).  Inside a worker (a retry, a pipeline step) the
        # message being processed is acked once this returns, so keep trying for a while
        # rather than let Dramatiq ack the work away; elsewhere retry once, for a connection
        # that died in the pool, and let the caller see the error.
        deadline = time.monotonic() + (self.worker_write_timeout_ms / 1000 if _in_worker_thread() else 0)
        delay = 0.05
        attempt = 0
        while True:
            attempt += 1
            try:
                wait_ms = max(500, int((deadline - time.monotonic()) * 1000)) if deadline > time.monotonic() else None
                with self.database.connection(timeout_ms=wait_ms) as pooled, pooled.transaction():
                    self._execute(pooled, params)
                return
            except (OutboxWriteError, PoolTimeout, psycopg.OperationalError) as error:
                cause = error.__cause__ if isinstance(error, OutboxWriteError) else error
                transient = isinstance(cause, (psycopg.OperationalError, PoolTimeout))
                if not transient or (attempt >= 2 and time.monotonic() >= deadline):
                    self._fail_current_message(params[0])
                    if isinstance(error, OutboxWriteError):
                        raise
                    raise OutboxWriteError(
                        f"could not write message {params[0]!r} to the outbox in schema {self.schema!r}: "
                        f"{type(error).__name__}: {error}; the message was not sent, check the database connection"
                    ) from error
                if attempt >= 2:
                    logger.warning(
                        "outbox write of message %s failed (%s); retrying in %.2fs",
                        params[0],
                        type(cause).__name__,
                        delay,
                    )
                    time.sleep(delay)
                    delay = min(delay * 2, 2.0)

    def _fail_current_message(self, message_id: str) -> None:
        # Dramatiq swallows exceptions raised by after-hooks (where retries are enqueued) and
        # then acks the message.  Failing it instead routes it to RabbitMQ's .XQ, where it is
        # kept; losing a retry quietly is the one outcome we never allow.
        processing = _processing.get()
        if processing is not None and _in_worker_thread():
            processing.fail()
            logger.critical(
                "could not write message %s to the outbox from a worker; failed message %s instead so "
                "RabbitMQ keeps it in its dead-letter queue (.XQ) rather than acking it away",
                message_id,
                processing.message_id,
            )

    def _execute(self, conn: psycopg.Connection[Any], params: tuple[Any, ...]) -> None:
        if not self._checked_schema:
            self._check_schema(conn)
        try:
            conn.execute(_sql.query("outbox_insert", self.schema), params)
        except psycopg.errors.UndefinedTable as error:
            self._checked_schema = False
            raise SchemaNotReady(
                f"outbox table {self.schema!r}.'outbox' does not exist; run 'dramatiq-reliable migrate'"
            ) from error
        except psycopg.Error as error:
            raise OutboxWriteError(
                f"could not write message {params[0]!r} to the outbox in schema {self.schema!r}: "
                f"{type(error).__name__}: {error}; the message was not sent, check the database connection "
                "and retry the transaction"
            ) from error

    def _check_schema(self, conn: psycopg.Connection[Any]) -> None:
        with self._check_lock:
            try:
                schema.ensure_ready(conn, schema=self.schema, required=schema.OUTBOX_VERSION, feature="outbox")
            except psycopg.Error as error:
                raise OutboxWriteError(
                    f"could not check the outbox schema {self.schema!r}: {type(error).__name__}: {error}; "
                    "check the database connection"
                ) from error
            self._checked_schema = True


_processing: contextvars.ContextVar[MessageProxy | None] = contextvars.ContextVar(
    "dramatiq_reliable_processing", default=None
)


class _TrackProcessing(Middleware):
    """Remembers the message a worker thread is processing, so a failed outbox write can fail it."""

    def after_worker_boot(self, broker: Broker, worker: Any) -> None:
        if not isinstance(broker, OutboxBroker):
            return
        threads = int(getattr(worker, "worker_threads", 0) or 0)
        size = int(getattr(broker.database.pool, "max_size", 0) or 0)
        if size and size < threads + 2:
            logger.warning(
                "the Postgres pool holds %d connections for %d worker threads; transactional Idempotency holds "
                "one per running job and the relay and dead letters need more: build the broker with "
                "pool_max_size=%d (or pass a larger pool as database=)",
                size,
                threads,
                threads + 2,
            )

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        _processing.set(message)

    def after_process_message(
        self, broker: Broker, message: MessageProxy, *, result: Any = None, exception: BaseException | None = None
    ) -> None:
        _processing.set(None)

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        _processing.set(None)


def _in_worker_thread() -> bool:
    return isinstance(threading.current_thread(), WorkerThread)
