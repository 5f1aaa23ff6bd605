"""PostgresBroker: Dramatiq queues in a Postgres table, for teams that run Postgres and nothing else.

``send()`` inside ``broker.transaction()`` or :func:`~dramatiq_reliable.bind` is one insert in
the caller's transaction (no outbox, no relay: the queue row *is* the message), workers claim
rows with ``FOR UPDATE SKIP LOCKED`` and hold them by a lease, and the same middleware
(``Idempotency``, ``ClassifiedRetries``, ``DeadLetters``, ``Tracing``) and CLI work unchanged.
Moving to RabbitMQ later is one line: build an ``OutboxBroker`` instead (docs/postgres-broker.md).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import random
from collections.abc import Iterator
from typing import Any, ClassVar

import psycopg
from dramatiq.broker import Broker, MessageProxy
from dramatiq.common import q_name, xq_name
from dramatiq.errors import QueueNotFound
from dramatiq.message import Message
from dramatiq.middleware import Middleware, Retries

from .. import _sql, dedupe, schema
from .._checks import check_int, check_ms
from ..backing import SendsTo
from ..binding import bound_connection
from ..database import DatabaseLike
from ..dedupe import DedupeOptions
from ..errors import ConfigurationError, SchemaNotReady
from ..joining import join_until_empty
from ..retries import ClassifiedRetries
from ..sending import DEFAULT_PAYLOAD_LIMIT_BYTES, Row, RowSending, TrackProcessing, Unbound, processing_message
from . import queue, retention
from .claims import ClaimListeners
from .consumer import Listener, PostgresConsumer, PostgresMessage
from .lease import Leases
from .readiness import SchemaGate

__all__ = ["PostgresBroker"]

logger = logging.getLogger("dramatiq_reliable.postgres")

#: An idle consumer's longest sleep between claims: the relay's default ceiling, for the same
#: trade (the first message after a quiet spell waits at most this; an idle consumer makes about
#: 5 empty claims a second, a few tens of microseconds of Postgres CPU each).
DEFAULT_POLL_INTERVAL_MS = 250

#: How long a dead ``.XQ`` row is kept when no ``DeadLetters`` middleware stored it: RabbitMQ's
#: default for Dramatiq's dead-letter queues (7 days).
DEFAULT_DEAD_MESSAGE_TTL_MS = 7 * 86_400_000


class PostgresBroker(RowSending, Broker):
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
    Producers notify nobody (a NOTIFY per commit would serialise producers' commits): each
    consumer claims again at once after a claim that found rows, and after an empty one sleeps
    from about 1 ms up to ``poll_interval_ms``; a send in the worker's own process wakes its
    consumers at once (:mod:`dramatiq_reliable.postgres.consumer`, docs/postgres-broker.md).

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
      payload_limit_bytes: encoded size above which a send is refused with ``PayloadError``
        (default 16 MiB); ``None`` disables it.
      worker_write_timeout_ms: how long a send made inside a worker keeps trying while
        Postgres is unreachable.
      pool_max_size: connections in the pool the broker creates from a URL; give it the
        worker's threads plus a few (consumers, heartbeat and a transactional job each borrow one).
      lease_ms: how long a claimed row stays hidden without a heartbeat: the delay before a
        dead worker's messages run elsewhere.
      heartbeat_ms: how often a live process extends its leases (default a third of the lease).
      claim_batch_size: the most rows one claim takes (the prefetch caps it too).
      dead_message_ttl_ms: how long a dead ``.XQ`` row is kept.
      poll_interval_ms: the idle ceiling: the longest sleep of an idle consumer between two
        claims, so the longest a message sent by another process (or a plain ``INSERT``) waits
        after a quiet spell (a delayed row wakes it when due).  Each idle consumer (one per
        queue per worker process) costs about ``1000 / (0.75 * poll_interval_ms)`` empty claims
        a second, and as many probes of when the next delayed row falls due.
      middleware: as for any Dramatiq broker.
      listen_database: a direct Postgres URL (or Database) for the ``LISTEN`` connection when
        ``database`` goes through PgBouncer in transaction mode; without it the broker detects
        the pooler and holds no ``LISTEN`` (logged once): consumers find rows as fast, only
        :func:`~dramatiq_reliable.postgres.wake_consumers` is not heard.

    >>> broker = PostgresBroker(database="postgresql://app@localhost/app")
    >>> dramatiq.set_broker(broker)                                       # doctest: +SKIP
    >>> with broker.transaction() as conn:                                # doctest: +SKIP
    ...     conn.execute("INSERT INTO orders (id) VALUES (%s)", (42,))
    ...     send_receipt.send(42)
    """

    sends_to: ClassVar[SendsTo] = "queue"
    table: ClassVar[str] = "queue"
    required_version: ClassVar[int] = schema.QUEUE_VERSION
    insert_query: ClassVar[str] = "queue_insert"
    insert_dedupe_query: ClassVar[str] = "queue_insert_dedupe"

    def __init__(
        self,
        *,
        database: DatabaseLike,
        schema: str = _sql.DEFAULT_SCHEMA,
        on_unbound: Unbound = "autocommit",
        max_payload_bytes: int | None = 64 * 1024,
        payload_limit_bytes: int | None = DEFAULT_PAYLOAD_LIMIT_BYTES,
        worker_write_timeout_ms: int = 30_000,
        pool_max_size: int = 16,
        lease_ms: int = 30_000,
        heartbeat_ms: int | None = None,
        claim_batch_size: int = 100,
        dead_message_ttl_ms: int = DEFAULT_DEAD_MESSAGE_TTL_MS,
        poll_interval_ms: int = DEFAULT_POLL_INTERVAL_MS,
        middleware: list[Middleware] | None = None,
        listen_database: DatabaseLike | None = None,
    ) -> None:
        check_ms("lease_ms", lease_ms, minimum=100, fix="e.g. lease_ms=30000")
        if heartbeat_ms is None:
            heartbeat_ms = max(50, lease_ms // 3)
        check_ms("heartbeat_ms", heartbeat_ms, minimum=10, fix="give it a third of lease_ms or less")
        if heartbeat_ms >= lease_ms:
            raise ConfigurationError(
                f"heartbeat_ms={heartbeat_ms!r} must be shorter than lease_ms={lease_ms!r}, or leases lapse "
                "while their jobs run; give it a third of lease_ms or less"
            )
        check_int("claim_batch_size", claim_batch_size, minimum=1, fix="e.g. claim_batch_size=100")
        check_ms("dead_message_ttl_ms", dead_message_ttl_ms, minimum=1, fix="e.g. 7 days, 604800000")
        check_ms("poll_interval_ms", poll_interval_ms, minimum=1, fix="e.g. poll_interval_ms=250")
        self._init_sending(
            database=database,
            schema=schema,
            on_unbound=on_unbound,
            max_payload_bytes=max_payload_bytes,
            payload_limit_bytes=payload_limit_bytes,
            worker_write_timeout_ms=worker_write_timeout_ms,
            pool_max_size=pool_max_size,
        )
        self.lease_ms = lease_ms
        self.heartbeat_ms = heartbeat_ms
        self.claim_batch_size = claim_batch_size
        self.dead_message_ttl_ms = dead_message_ttl_ms
        self.poll_interval_ms = poll_interval_ms
        # Lease tokens: distinct per claim, and per process with overwhelming likelihood.
        self._lease_tokens = itertools.count(random.getrandbits(62) + 1)
        self.schema_gate = SchemaGate(self._check_queue_table, schema=self.schema)
        self.listener = Listener(
            self.database, self.schema, on_notify=self.schema_gate.nudge, listen_database=listen_database
        )
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
        #: Told of each batch of claimed messages before a worker thread sees them (OrderedKeys).
        self.claims = ClaimListeners()
        # The tracker comes first (its before-hook runs before any other), the settler right
        # before the retry middleware (its after-hook runs after the retry decision and before
        # Idempotency commits the job's transaction).
        DedupeOptions.install(self)
        TrackProcessing.install(self)
        retries = [m for m in self.middleware if isinstance(m, (Retries, ClassifiedRetries))]
        if retries:
            self.add_middleware(AckInJobTransaction(), before=type(retries[-1]))
        else:
            self.add_middleware(AckInJobTransaction())

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
        with self._tables() as conn:
            queue.flush(conn, self.schema, [queue_name, xq_name(queue_name)])

    def flush_all(self) -> None:
        """Drop every message of every declared queue."""
        names = [name for queue_name in self.queues for name in (queue_name, xq_name(queue_name))]
        if names:
            with self._tables() as conn:
                queue.flush(conn, self.schema, names)

    def join(
        self, queue_name: str, min_successes: int = 10, idle_time: int = 100, *, timeout: int | None = None
    ) -> None:
        """Wait until ``queue_name`` holds no message that is waiting, delayed or being processed.

        The same contract as ``RabbitmqBroker.join``: the queue is counted every ``idle_time``
        milliseconds and must be empty ``min_successes`` times in a row; ``QueueJoinTimeout``
        is raised after ``timeout`` milliseconds.  Unlike RabbitMQ's count, this one includes
        messages claimed and still running, so an empty count means the queue is done; pass
        ``min_successes=1`` to return at the first one (the default also waits out messages
        that a job running on another queue may still send here).
        """
        if queue_name not in self.queues:
            raise QueueNotFound(queue_name)  # type: ignore[no-untyped-call]

        def pending() -> int:
            self.leases.flush()  # this process's acks still waiting to be written
            with self._tables() as conn:
                return queue.pending(conn, self.schema, queue_name)

        join_until_empty(queue_name, pending, min_successes=min_successes, idle_time=idle_time, timeout=timeout)

    def counts(self) -> list[queue.QueueCounts]:
        """Every Postgres queue's ready, delayed and held messages and oldest ready age."""
        with self._tables() as conn:
            return queue.counts(conn, self.schema)

    @contextlib.contextmanager
    def _tables(self) -> Iterator[psycopg.Connection[Any]]:
        """A pooled autocommit connection whose statements raise ``SchemaNotReady`` on an unmigrated schema."""
        with self.database.autocommit() as conn:
            try:
                yield conn
            except (psycopg.errors.UndefinedTable, psycopg.errors.InvalidSchemaName) as error:
                raise SchemaNotReady(
                    f"table {self.schema!r}.{self.table!r} does not exist; run {schema.migrate_command(self.schema)!r}"
                ) from error

    def _check_queue_table(self) -> None:
        with self.database.autocommit() as conn:
            schema.ensure_ready(conn, schema=self.schema, required=self.required_version, feature="queue")

    def _housekeeping(self, conn: psycopg.Connection[Any]) -> None:
        retention.purge_dead(conn, schema=self.schema, older_than_ms=self.dead_message_ttl_ms)
        dedupe.purge_on(conn, self.schema)

    # -- sending ---------------------------------------------------------------------------------

    def _row(self, message: Message[Any], canonical: str, body: bytes) -> Row:
        # One queue per name: a delayed message waits in its own queue until available_at.
        row = super()._row(message, canonical, body)
        row["queue_name"] = canonical
        row["priority"] = row["priority"] or 0
        return row

    def _written(self, row: Row) -> None:
        # This process's consumers of the queue probe now and fast again: free (no round trip,
        # no NOTIFY), and a row still to commit is found by the short sleeps that follow.
        if row["eta_ms"] is None:
            self.listener.wake(row["queue_name"])

    def _held(self, message: Message[Any], row: Row) -> PostgresMessage | None:
        """The queue row this worker thread holds, when ``message`` is its retry."""
        held = processing_message()
        if (
            isinstance(held, PostgresMessage)
            and not held.settled
            and held.message_id == message.message_id
            and held.queue_name == row["queue_name"]
        ):
            return held
        return None

    def _write_held(self, conn: psycopg.Connection[Any], message: Message[Any], row: Row) -> bool:
        # A retry turns the held row into its own retry in one statement.
        held = self._held(message, row)
        if held is None:
            return False
        if not self._checked_schema:
            self._check_schema(conn)
        done = queue.retry_in_place(
            conn,
            self.schema,
            row_id=held.row_id,
            lease=held.lease,
            body=row["body"],
            priority=row["priority"] or 0,
            eta_ms=row["eta_ms"],
        )
        if done:
            held.settled = True
            self.leases.forget(held.row_id)
        return done

    def _worker_gave_up(self, message: Message[Any]) -> None:
        held = processing_message()
        if isinstance(held, PostgresMessage) and not held.settled and held.message_id == message.message_id:
            # Leave the message to its lease rather than ack it without its retry.
            held.settled = True
            logger.critical(
                "could not write the retry of message %s; it is not acked and runs again when its lease ends",
                message.message_id,
            )
            return
        super()._worker_gave_up(message)


class AckInJobTransaction(Middleware):
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
