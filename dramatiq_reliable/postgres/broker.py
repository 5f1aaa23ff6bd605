"""PostgresBroker: Dramatiq queues in a Postgres table, for teams that run Postgres and nothing else.

``send()`` inside ``broker.transaction()`` or :func:`~dramatiq_reliable.bind` is one insert in
the caller's transaction (no outbox, no relay: the queue row *is* the message), workers claim
rows with ``FOR UPDATE SKIP LOCKED`` and hold them by a lease, and the same middleware
(``Idempotency``, ``ClassifiedRetries``, ``DeadLetters``, ``Tracing``) and CLI work unchanged.
Moving to RabbitMQ later is one line: build an ``OutboxBroker`` instead (docs/postgres-broker.md).
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import logging
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
from dramatiq.broker import Broker, MessageProxy
from dramatiq.common import current_millis, dq_name, q_name, xq_name
from dramatiq.errors import QueueJoinTimeout, QueueNotFound
from dramatiq.message import Message
from dramatiq.middleware import Middleware, Retries
from dramatiq.worker import WorkerThread
from psycopg_pool import PoolTimeout

from .. import _sql, schema
from .._util import check_ms, first_line
from ..database import Database, DatabaseLike
from ..errors import ConfigurationError, NotBound, OutboxWriteError, PayloadError, SchemaNotReady
from ..outbox.binding import bound_connection, bound_transaction
from ..outbox.broker import Unbound
from ..retries import ClassifiedRetries
from . import queue, retention
from .consumer import Listener, PostgresConsumer, PostgresMessage
from .lease import Leases

__all__ = ["PostgresBroker"]

logger = logging.getLogger("dramatiq_reliable.postgres")

#: How long a dead ``.XQ`` row is kept when no ``DeadLetters`` middleware stored it: RabbitMQ's
#: default for Dramatiq's dead-letter queues (7 days).
DEFAULT_DEAD_MESSAGE_TTL_MS = 7 * 86_400_000


class PostgresBroker(Broker):
    """A Dramatiq broker whose queues are rows of the ``queue`` table in our schema.

    Where a message goes when it is sent:

    * inside :meth:`transaction` or :func:`~dramatiq_reliable.bind`: one row in the bound
      connection's transaction, visible to workers when it commits, gone if it rolls back.
    * anywhere else, as with ``OutboxBroker``: ``on_unbound="autocommit"`` (the default) inserts
      and commits the row before ``send()`` returns; ``on_unbound="error"`` raises
      :class:`~dramatiq_reliable.NotBound`.  Sends a worker makes (retries, pipelines,
      callbacks) are never refused and keep trying for ``worker_write_timeout_ms``.
    * a delay (``send_with_options(delay=...)``, a retry's backoff) is the row's
      ``available_at``: nothing waits in worker memory, and a worker restart loses no delay.
    * ``broker_priority`` (0-255, higher first) orders a queue's visible rows, as in RabbitMQ.

    How messages are consumed: a worker's consumer claims up to its prefetch with ``FOR UPDATE
    SKIP LOCKED``, each row under a lease of ``lease_ms`` that a heartbeat extends every
    ``heartbeat_ms`` while the process lives.  A process that dies holds nothing for longer
    than the lease: its rows become visible again and another worker runs them (at least once).
    Consumers wake on ``LISTEN/NOTIFY`` and poll every ``worker_timeout`` as a fallback.

    An ack deletes the row; when a connection is bound as the job ends (``Idempotency`` in
    transactional mode binds the job's), the delete joins that transaction, so the job's
    writes, its key and its ack commit together.  A retry turns the held row into its own
    retry in one statement.  A nack deletes the row once ``DeadLetters`` stored it, and
    otherwise keeps it as ``<queue>.XQ`` for ``dead_message_ttl_ms``.

    Parameters:
      database: a Postgres URL, a ``psycopg_pool.ConnectionPool`` (shared, never closed by the
        broker) or a :class:`~dramatiq_reliable.Database`.
      schema: the Postgres schema holding the tables (``dramatiq-reliable migrate``).
      on_unbound: ``"autocommit"`` or ``"error"``, see above.
      max_payload_bytes: encoded size above which a send logs a warning; ``None`` disables it.
      worker_write_timeout_ms: how long a send made inside a worker keeps trying while
        Postgres is unreachable.
      pool_max_size: connections in the pool the broker creates from a URL; give it the
        worker's threads plus a few (consumers, heartbeat and a transactional job each borrow one).
      lease_ms: how long a claimed row stays hidden without a heartbeat: the delay before a
        dead worker's messages run elsewhere.
      heartbeat_ms: how often a live process extends its leases (default a third of the lease).
      claim_batch_size: the most rows one claim takes (the prefetch caps it too).
      dead_message_ttl_ms: how long a dead ``.XQ`` row is kept.
      middleware: as for any Dramatiq broker.

    >>> broker = PostgresBroker(database="postgresql://app@localhost/app")
    >>> dramatiq.set_broker(broker)                                       # doctest: +SKIP
    >>> with broker.transaction() as conn:                                # doctest: +SKIP
    ...     conn.execute("INSERT INTO orders (id) VALUES (%s)", (42,))
    ...     send_receipt.send(42)
    """

    def __init__(
        self,
        *,
        database: DatabaseLike,
        schema: str = _sql.DEFAULT_SCHEMA,
        on_unbound: Unbound = "autocommit",
        max_payload_bytes: int | None = 64 * 1024,
        worker_write_timeout_ms: int = 30_000,
        pool_max_size: int = 16,
        lease_ms: int = 30_000,
        heartbeat_ms: int | None = None,
        claim_batch_size: int = 100,
        dead_message_ttl_ms: int = DEFAULT_DEAD_MESSAGE_TTL_MS,
        middleware: list[Middleware] | None = None,
    ) -> None:
        if on_unbound not in ("autocommit", "error"):
            raise ConfigurationError(f"on_unbound must be 'autocommit' or 'error', got {on_unbound!r}")
        if max_payload_bytes is not None and (
            isinstance(max_payload_bytes, bool) or not isinstance(max_payload_bytes, int) or max_payload_bytes <= 0
        ):
            raise ConfigurationError(f"max_payload_bytes must be a positive int or None, got {max_payload_bytes!r}")
        check_ms("worker_write_timeout_ms", worker_write_timeout_ms, fix="e.g. worker_write_timeout_ms=30000")
        check_ms("lease_ms", lease_ms, minimum=100, fix="e.g. lease_ms=30000")
        if heartbeat_ms is None:
            heartbeat_ms = max(50, lease_ms // 3)
        check_ms("heartbeat_ms", heartbeat_ms, minimum=10, fix="give it a third of lease_ms or less")
        if heartbeat_ms >= lease_ms:
            raise ConfigurationError(
                f"heartbeat_ms={heartbeat_ms!r} must be shorter than lease_ms={lease_ms!r}, or leases lapse "
                "while their jobs run; give it a third of lease_ms or less"
            )
        if isinstance(claim_batch_size, bool) or not isinstance(claim_batch_size, int) or claim_batch_size < 1:
            raise ConfigurationError(f"claim_batch_size must be a positive int, got {claim_batch_size!r}")
        check_ms("dead_message_ttl_ms", dead_message_ttl_ms, minimum=1, fix="e.g. 7 days, 604800000")
        self.schema = _sql.validate_schema(schema)
        self.database = Database.of(database, max_size=pool_max_size)
        self.on_unbound: Unbound = on_unbound
        self.max_payload_bytes = max_payload_bytes
        self.worker_write_timeout_ms = worker_write_timeout_ms
        self.lease_ms = lease_ms
        self.heartbeat_ms = heartbeat_ms
        self.claim_batch_size = claim_batch_size
        self.dead_message_ttl_ms = dead_message_ttl_ms
        # Lease tokens: distinct per claim, and per process with overwhelming likelihood.
        self._lease_tokens = itertools.count(random.getrandbits(62) + 1)
        self._checked_schema = False
        self._check_lock = threading.Lock()
        self.listener = Listener(self.database, self.schema)
        self.leases = Leases(
            self.database,
            self.schema,
            lease_ms=lease_ms,
            heartbeat_ms=heartbeat_ms,
            on_release=self.listener.wake,
            housekeeping=self._housekeeping,
        )
        super().__init__(middleware=middleware)
        self.queues: set[str] = set()
        # The tracker comes first (its before-hook runs before any other), the settler right
        # before the retry middleware (its after-hook runs after the retry decision and before
        # Idempotency commits the job's transaction).
        tracker = _TrackMessage()
        if self.middleware:
            self.add_middleware(tracker, before=type(self.middleware[0]))
        else:
            self.add_middleware(tracker)
        retries = [m for m in self.middleware if isinstance(m, (Retries, ClassifiedRetries))]
        if retries:
            self.add_middleware(_AckInJobTransaction(), before=type(retries[-1]))
        else:
            self.add_middleware(_AckInJobTransaction())

    # -- binding ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def transaction(self) -> Iterator[psycopg.Connection[Any]]:
        """Open a pooled connection and transaction, and bind it for ``send()``.

        The transaction commits when the block exits normally and rolls back when it raises.
        """
        with bound_transaction(self.database) as conn:
            yield conn

    def close(self) -> None:
        """Stop the listener and heartbeat (acks still pending are written) and close the pool it created."""
        self.listener.stop()
        self.leases.stop()
        self.database.close()

    # -- queues ----------------------------------------------------------------------------------

    def consume(self, queue_name: str, prefetch: int = 1, timeout: int = 1000) -> PostgresConsumer:
        """A consumer of ``queue_name`` that holds at most ``prefetch`` messages at a time."""
        if q_name(queue_name) != queue_name or queue_name not in self.queues:
            raise QueueNotFound(queue_name)  # type: ignore[no-untyped-call]
        return PostgresConsumer(self, queue_name, prefetch, timeout)

    def declare_queue(self, queue_name: str) -> None:
        """Register a queue (no I/O: a queue is a name in the table, there is nothing to create)."""
        canonical = q_name(queue_name)
        if canonical in self.queues:
            return
        self.emit_before("declare_queue", canonical)
        self.queues.add(canonical)
        self.emit_after("declare_queue", canonical)

    def get_declared_queues(self) -> set[str]:
        return set(self.queues)

    def flush(self, queue_name: str) -> None:
        """Drop every message of ``queue_name``: waiting, delayed, held and dead (``.XQ``)."""
        with queue.pooled(self.database) as conn:
            queue.flush(conn, self.schema, [queue_name, xq_name(queue_name)])

    def flush_all(self) -> None:
        """Drop every message of every declared queue."""
        names = [name for queue_name in self.queues for name in (queue_name, xq_name(queue_name))]
        if names:
            with queue.pooled(self.database) as conn:
                queue.flush(conn, self.schema, names)

    def join(self, queue_name: str, *, timeout: int | None = None, interval_ms: int = 20) -> None:
        """Wait until ``queue_name`` holds no message that is waiting, delayed or being processed.

        Unlike RabbitMQ's join it counts held (unacked) rows too, so a message still running
        keeps it waiting.  Raises ``QueueJoinTimeout`` after ``timeout`` milliseconds.
        """
        if queue_name not in self.queues:
            raise QueueNotFound(queue_name)  # type: ignore[no-untyped-call]
        deadline = None if timeout is None else time.monotonic() + timeout / 1000
        while True:
            self.leases.flush()
            with queue.pooled(self.database) as conn:
                if queue.pending(conn, self.schema, queue_name) == 0:
                    return
            if deadline is not None and time.monotonic() >= deadline:
                raise QueueJoinTimeout(queue_name)  # type: ignore[no-untyped-call]
            time.sleep(interval_ms / 1000)

    def counts(self) -> list[queue.QueueCounts]:
        """Every Postgres queue's ready, delayed and held messages and oldest ready age."""
        with queue.pooled(self.database) as conn:
            return queue.counts(conn, self.schema)

    def _housekeeping(self, conn: psycopg.Connection[Any]) -> None:
        retention.purge_dead(conn, schema=self.schema, older_than_ms=self.dead_message_ttl_ms)

    # -- sending ---------------------------------------------------------------------------------

    def enqueue(self, message: Message[Any], *, delay: int | None = None) -> Message[Any]:
        """Write ``message`` as a queue row (see the class docstring for which transaction)."""
        if delay is not None and (isinstance(delay, bool) or not isinstance(delay, int) or delay < 0):
            raise ConfigurationError(f"delay must be a non-negative int of milliseconds, got {delay!r}")
        canonical = q_name(message.queue_name)
        if delay is not None:
            message = message.copy(queue_name=dq_name(canonical), options={"eta": current_millis() + delay})
        priority = _priority(message)
        self._encode(message)
        self.declare_queue(canonical)
        self.emit_before("enqueue", message, delay)
        # Encoded again: before_enqueue hooks may have added options (trace context).
        body = self._encode(message, warn=False)
        eta = message.options.get("eta")
        row = {
            "queue_name": canonical,
            "message_id": message.message_id,
            "actor_name": message.actor_name,
            "body": body,
            "priority": priority,
            "eta_ms": int(eta) if isinstance(eta, (int, float)) and not isinstance(eta, bool) else None,
        }
        self._write(message, row)
        self.emit_after("enqueue", message, delay)
        return message

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

    def _write(self, message: Message[Any], row: dict[str, Any]) -> None:
        conn = bound_connection()
        if conn is not None:
            self._execute(conn, row)
            return
        in_worker = isinstance(threading.current_thread(), WorkerThread)
        if self.on_unbound == "error" and not in_worker:
            raise NotBound(
                f"send() of actor {message.actor_name!r} outside a transaction; wrap it in "
                "'with broker.transaction():' or 'with bind(conn):', or build the broker with on_unbound='autocommit'"
            )
        held = _processing.get() if in_worker else None
        if held is not None and (
            held.settled or held.message_id != message.message_id or held.queue_name != row["queue_name"]
        ):
            held = None
        # Autocommit on a pooled connection.  A worker keeps trying for a while (the message it
        # runs would otherwise be acked without its retry); elsewhere the caller sees the error.
        deadline = time.monotonic() + (self.worker_write_timeout_ms / 1000 if in_worker else 0)
        pause = 0.05
        attempt = 0
        while True:
            attempt += 1
            try:
                with queue.pooled(self.database, timeout_ms=5000 if in_worker else None) as pooled:
                    if held is not None and self._retry_in_place(pooled, held, row):
                        return
                    self._execute(pooled, row)
                return
            except (OutboxWriteError, PoolTimeout, psycopg.OperationalError) as error:
                cause = error.__cause__ if isinstance(error, OutboxWriteError) else error
                transient = isinstance(cause, (psycopg.OperationalError, PoolTimeout))
                if not transient or (attempt >= 2 and time.monotonic() >= deadline):
                    if held is not None:
                        # Leave the message to its lease rather than ack it without its retry.
                        held.settled = True
                        logger.critical(
                            "could not write the retry of message %s; it is not acked and runs again when its "
                            "lease ends",
                            message.message_id,
                        )
                    if isinstance(error, OutboxWriteError):
                        raise
                    raise self._write_error(row, error) from error
                if attempt >= 2:
                    logger.warning(
                        "queue write of message %s failed (%s); retrying in %.2fs",
                        message.message_id,
                        type(cause).__name__,
                        pause,
                    )
                    time.sleep(pause)
                    pause = min(pause * 2, 2.0)

    def _retry_in_place(self, conn: psycopg.Connection[Any], held: PostgresMessage, row: dict[str, Any]) -> bool:
        if not self._checked_schema:
            self._check_schema(conn)
        done = queue.retry_in_place(
            conn,
            self.schema,
            row_id=held.row_id,
            lease=held.lease,
            body=row["body"],
            priority=row["priority"],
            eta_ms=row["eta_ms"],
        )
        if done:
            held.settled = True
            self.leases.forget(held.row_id)
        return done

    def _execute(self, conn: psycopg.Connection[Any], row: dict[str, Any]) -> None:
        if not self._checked_schema:
            self._check_schema(conn)
        try:
            queue.insert(conn, self.schema, **row)
        except psycopg.errors.UndefinedTable as error:
            self._checked_schema = False
            raise SchemaNotReady(
                f"queue table {self.schema!r}.'queue' does not exist; run 'dramatiq-reliable migrate'"
            ) from error
        except psycopg.Error as error:
            raise self._write_error(row, error) from error

    def _write_error(self, row: dict[str, Any], error: BaseException) -> OutboxWriteError:
        return OutboxWriteError(
            f"could not write message {row['message_id']!r} to queue {row['queue_name']!r} in schema "
            f"{self.schema!r}: {type(error).__name__}: {first_line(error)}; the message was not sent, check the "
            "database connection and retry the transaction"
        )

    def _check_schema(self, conn: psycopg.Connection[Any]) -> None:
        with self._check_lock:
            try:
                schema.ensure_ready(conn, schema=self.schema, required=schema.QUEUE_VERSION, feature="Postgres queues")
            except psycopg.Error as error:
                raise OutboxWriteError(
                    f"could not check the queue schema {self.schema!r}: {type(error).__name__}: {first_line(error)}; "
                    "check the database connection"
                ) from error
            self._checked_schema = True


def _priority(message: Message[Any]) -> int:
    priority = message.options.get("broker_priority")
    if priority is None:
        return 0
    if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= 255:
        raise PayloadError(
            f"message {message.message_id!r} for actor {message.actor_name!r} has broker_priority={priority!r}; "
            "priorities are ints from 0 to 255 (higher runs first), as in RabbitMQ"
        )
    return priority


_processing: contextvars.ContextVar[PostgresMessage | None] = contextvars.ContextVar(
    "dramatiq_reliable_postgres_processing", default=None
)


class _TrackMessage(Middleware):
    """Remembers the queue row a worker thread runs, so its retry can replace it in place."""

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        _processing.set(message if isinstance(message, PostgresMessage) else None)

    def after_process_message(
        self, broker: Broker, message: MessageProxy, *, result: Any = None, exception: BaseException | None = None
    ) -> None:
        _processing.set(None)

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        _processing.set(None)


class _AckInJobTransaction(Middleware):
    """Deletes a succeeded job's row on the connection bound as it ends, inside that transaction.

    ``Idempotency`` (transactional) binds the job's connection and commits it in its own
    after-hook, which runs after this one: the row, the key and the job's writes then commit
    together.  If that commit fails, the message is failed and the rolled-back row is nacked.
    """

    def after_process_message(
        self, broker: Broker, message: MessageProxy, *, result: Any = None, exception: BaseException | None = None
    ) -> None:
        if exception is not None or message.failed or not isinstance(message, PostgresMessage) or message.settled:
            return
        if not isinstance(broker, PostgresBroker):
            return
        conn = bound_connection()
        if conn is None or conn.info.transaction_status != psycopg.pq.TransactionStatus.INTRANS:
            return
        queue.ack(conn, broker.schema, [(message.row_id, message.lease)])
        message.settled = True
