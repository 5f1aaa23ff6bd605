"""The one send path of every Postgres-backed broker: validate, encode, write a row in the caller's transaction.

``OutboxBroker`` and ``PostgresBroker`` differ only in the table a send writes to; everything
else a send does is here, once:

* **Validation before any SQL.**  A bad ``delay`` or ``eta`` (not an int, a bool, infinite,
  past the year 9999), a priority outside 0-255, a queue name, actor name, message id or
  idempotency key Postgres cannot store, or a payload that cannot be encoded or is over
  ``payload_limit_bytes`` raises :class:`~dramatiq_reliable.PayloadError` in the caller before
  a statement runs, so the caller's transaction is untouched and can still commit.
* **Which transaction.**  Inside ``broker.transaction()`` or :func:`~dramatiq_reliable.bind`,
  the row joins the bound transaction, after a check (no round trip) that it is one: not a
  connection in autocommit with no transaction open, not a failed transaction, not another
  database (``NotBound`` names the fix).  Where nothing is bound, a transaction an ambient
  source sees (Django's ``atomic()``, see :func:`~dramatiq_reliable.binding.register_ambient`)
  is joined, and inside an async binding a plain ``send()`` is refused.  Elsewhere ``on_unbound="autocommit"`` commits it on a
  pooled connection before ``send()`` returns, and ``on_unbound="error"`` raises ``NotBound``.
* **Sends a worker makes** (a retry, a pipeline's next step) are never refused and keep trying
  for ``worker_write_timeout_ms`` while Postgres is unreachable.  If they still cannot write,
  the message being processed is not acked away with its follow-up lost: each broker keeps it
  (``OutboxBroker`` fails it into RabbitMQ's ``.XQ``, ``PostgresBroker`` leaves it to its lease).
* **Dedupe at enqueue.**  A send with a ``dedupe_key`` (message or actor option) takes the key
  in the same transaction as its row; a duplicate inside the window writes nothing and
  returns the first message's id (see :mod:`dramatiq_reliable.dedupe`).
* **Middleware** see ``before_enqueue`` and ``after_enqueue`` around the write and, when it
  fails, ``after_enqueue_failed(broker, message, delay, *, exception)`` if they define it
  (Dramatiq has no such signal; ``Tracing`` closes its span there).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import datetime
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any, ClassVar, Literal, NamedTuple, TypedDict

import psycopg
from dramatiq.broker import Broker, MessageProxy
from dramatiq.common import current_millis, dq_name, q_name
from dramatiq.message import Message
from dramatiq.middleware import Middleware
from dramatiq.worker import WorkerThread
from psycopg.rows import dict_row
from psycopg_pool import PoolTimeout

from . import _sql
from . import dedupe as _dedupe
from . import schema as _schema
from ._checks import check_choice, check_int, check_ms
from ._util import first_line, redact
from .async_sending import BrokerTransaction
from .backing import SendsTo
from .binding import ambient_connection, bound_async_connection, bound_connection, check_joinable, joinable_connection
from .database import Database, DatabaseLike
from .errors import ConfigurationError, NotBound, OutboxWriteError, PayloadError, SchemaNotReady

__all__ = [
    "DEFAULT_PAYLOAD_LIMIT_BYTES",
    "MAX_ETA_MS",
    "Row",
    "RowSending",
    "TrackProcessing",
    "Unbound",
    "processing_message",
    "validate_send",
]

logger = logging.getLogger("dramatiq_reliable.sending")

Unbound = Literal["autocommit", "error"]

#: The last millisecond Python's datetime (and so every consumer of an eta) can represent.
MAX_ETA_MS = int(datetime.datetime(9999, 12, 31, 23, 59, 59, 999000, tzinfo=datetime.timezone.utc).timestamp() * 1000)

#: The default hard limit on an encoded message: RabbitMQ 4's default ``max_message_size``
#: (16 MiB).  A bigger message would be stored and then never published (the relay would retry
#: it for ever), or bloat the queue table; refusing it at ``send()`` says so to the caller.
DEFAULT_PAYLOAD_LIMIT_BYTES = 16 * 1024 * 1024


class Row(TypedDict):
    """The columns of one message's row: queue, ids, body, priority and eta in milliseconds."""

    queue_name: str
    message_id: str
    actor_name: str
    body: bytes
    priority: int | None
    eta_ms: int | None


def _where(message: Message[Any]) -> str:
    return f"message {message.message_id!r} for actor {message.actor_name!r}"


def _check_text(message: Message[Any], field: str, value: object, fix: str) -> None:
    # Postgres text refuses NUL and lone surrogates: caught here, before the insert could abort
    # the caller's transaction.
    if not isinstance(value, str) or not value.strip():
        raise PayloadError(f"{_where(message)} has {field}={value!r}, not a non-empty string; {fix}")
    if "\x00" in value:
        raise PayloadError(f"{_where(message)} has a {field} holding a NUL character; {fix}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise PayloadError(
            f"{_where(message)} has a {field} that is not valid Unicode ({error.reason}); {fix}"
        ) from None


def validate_send(message: Message[Any], delay: Any) -> None:
    """Raise :class:`~dramatiq_reliable.PayloadError` unless ``message`` sent with ``delay`` can be stored.

    Checks everything a row needs except the encoded size (see :meth:`RowSending.encode`).
    """
    if delay is not None and (isinstance(delay, bool) or not isinstance(delay, int) or delay < 0):
        raise PayloadError(
            f"{_where(message)} has delay={delay!r}; delay is a non-negative int of milliseconds "
            "(e.g. delay=60_000 for a minute)"
        )
    _check_text(message, "queue_name", message.queue_name, "give the actor a queue name (queue_name='default')")
    _check_text(message, "actor_name", message.actor_name, "declare the actor with a readable actor_name")
    _check_text(message, "message_id", message.message_id, "let Dramatiq generate message ids")
    if delay is not None and current_millis() + delay > MAX_ETA_MS:
        raise PayloadError(
            f"{_where(message)} has delay={delay!r}, which ends after the year 9999; pass a delay in "
            "milliseconds (e.g. delay=3_600_000 for an hour)"
        )
    eta = message.options.get("eta")
    if eta is not None:
        if isinstance(eta, bool) or not isinstance(eta, int):
            raise PayloadError(
                f"{_where(message)} has eta={eta!r}; eta is a Unix timestamp in milliseconds (an int), "
                "or pass delay= in milliseconds instead"
            )
        if not 0 <= eta <= MAX_ETA_MS:
            raise PayloadError(
                f"{_where(message)} has eta={eta!r}, outside the years 1970 to 9999; eta is a Unix timestamp in "
                "milliseconds (e.g. dramatiq.common.current_millis() + 60_000)"
            )
    priority = message.options.get("broker_priority")
    if priority is not None and (
        isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= 255
    ):
        raise PayloadError(
            f"{_where(message)} has broker_priority={priority!r}; priorities are ints from 0 to 255 (higher runs "
            "first; RabbitMQ queues also need max_priority= on the broker)"
        )
    key = message.options.get("idempotency_key")
    if key is not None:
        _check_text(
            message,
            "idempotency_key",
            key,
            "pass a non-empty string of readable characters, e.g. send_with_options(idempotency_key='order-42')",
        )


class _Attempts:
    """The attempts of one autocommit write: the first retry is at once, later ones back off
    from 50 ms to 2 s until ``budget_ms`` has passed (at least two attempts in all)."""

    def __init__(self, budget_ms: int) -> None:
        self.deadline = time.monotonic() + budget_ms / 1000
        self.count = 0
        self._pause = 0.05

    def next_timeout_ms(self) -> int | None:
        """Count an attempt; how long it may wait for a pooled connection (the pool's default if ``None``)."""
        self.count += 1
        remaining_ms = int((self.deadline - time.monotonic()) * 1000)
        return max(500, remaining_ms) if remaining_ms > 0 else None

    def over(self) -> bool:
        return self.count >= 2 and time.monotonic() >= self.deadline

    def pause(self) -> float:
        if self.count < 2:
            return 0.0
        pause, self._pause = self._pause, min(self._pause * 2, 2.0)
        return pause


class _Send(NamedTuple):
    """A send between its validation and its write."""

    message: Message[Any]
    delay: int | None
    row: Row
    dedupe: tuple[str, int] | None


class RowSending:
    """The send path of a broker whose messages are Postgres rows (mixed in before the Dramatiq broker class).

    A broker sets ``sends_to``, ``table`` and ``required_version``, calls
    :meth:`_init_sending` from its constructor, and writes its row in :meth:`_insert`; it may
    override :meth:`_row` (the columns), :meth:`_write_held` (a worker's retry of the message it
    holds) and :meth:`_worker_gave_up` (what keeps the processed message when a worker's send
    cannot be written).  It then meets :class:`~dramatiq_reliable.backing.PostgresBacked`.
    """

    sends_to: ClassVar[SendsTo]
    #: The table a send writes to, and the schema version that created it.
    table: ClassVar[str]
    required_version: ClassVar[int]
    #: The statements (``sql/<name>.sql``) writing a row, and a row with its dedupe key: the
    #: sync and async paths run the same ones.
    insert_query: ClassVar[str]
    insert_dedupe_query: ClassVar[str]

    database: Database
    schema: str
    on_unbound: Unbound
    max_payload_bytes: int | None
    payload_limit_bytes: int | None
    worker_write_timeout_ms: int
    _checked_dedupe: bool

    def _init_sending(
        self,
        *,
        database: DatabaseLike,
        schema: str,
        on_unbound: Unbound,
        max_payload_bytes: int | None,
        payload_limit_bytes: int | None,
        worker_write_timeout_ms: int,
        pool_max_size: int,
    ) -> None:
        self.on_unbound = check_choice("on_unbound", on_unbound, ("autocommit", "error"))
        self.max_payload_bytes = check_int("max_payload_bytes", max_payload_bytes, minimum=1, allow_none=True)
        self.payload_limit_bytes = check_int("payload_limit_bytes", payload_limit_bytes, minimum=1, allow_none=True)
        if (
            max_payload_bytes is not None
            and payload_limit_bytes is not None
            and max_payload_bytes > payload_limit_bytes
        ):
            raise ConfigurationError(
                f"max_payload_bytes={max_payload_bytes!r} (the warning) is over payload_limit_bytes="
                f"{payload_limit_bytes!r} (the refusal); give the warning the smaller size"
            )
        self.worker_write_timeout_ms = check_ms(
            "worker_write_timeout_ms", worker_write_timeout_ms, fix="e.g. worker_write_timeout_ms=30000"
        )
        check_int("pool_max_size", pool_max_size, minimum=1, fix="give it the worker's threads plus a few")
        self.schema = _sql.validate_schema(schema)
        self.database = Database.of(database, max_size=pool_max_size)
        self._checked_schema = False
        self._checked_dedupe = False
        self._check_lock = threading.Lock()

    # -- the caller's transaction ------------------------------------------------------------------

    def transaction(self) -> BrokerTransaction:
        """Open a pooled connection and transaction, and bind it for sends: ``with`` or ``async with``.

        The transaction commits when the block exits normally and rolls back when it raises;
        do your own writes on the yielded connection so they commit with the messages.  In
        async code (``async with broker.transaction() as conn``) the connection is a psycopg
        ``AsyncConnection`` of the broker's async pool and sends are ``await send_async(...)``.
        """
        return BrokerTransaction(self.database)

    async def aclose(self) -> None:
        """Close the broker from async code: the running loop's async pool first (it must be
        closed on its own loop), then everything ``close()`` closes, in a thread."""
        await self.database.aclose()
        await asyncio.to_thread(self.close)  # type: ignore[attr-defined]

    # -- sending -----------------------------------------------------------------------------------

    def enqueue(self, message: Message[Any], *, delay: int | None = None) -> Message[Any]:
        """Write ``message`` as a row (see the module docstring for which transaction).

        Returns the message sent or, when its dedupe key was held, the first message's id on a
        copy of ``message`` (nothing was written).
        """
        send = self._begin_send(message, delay)
        try:
            first = self._write(send.message, send.row, send.dedupe)
        except BaseException as error:
            self._emit_enqueue_failed(send.message, delay, error)
            raise
        return self._end_send(send, first)

    async def enqueue_async(self, message: Message[Any], *, delay: int | None = None) -> Message[Any]:
        """:meth:`enqueue` for async code: the same validation, dedupe and middleware; only the
        write differs (see :mod:`dramatiq_reliable.async_sending`)."""
        send = self._begin_send(message, delay)
        try:
            first = await self._write_async(send.message, send.row, send.dedupe)
        except BaseException as error:
            self._emit_enqueue_failed(send.message, delay, error)
            raise
        return self._end_send(send, first)

    def _begin_send(self, message: Message[Any], delay: int | None) -> _Send:
        """Everything a send does before its write, shared by the sync and async paths: validate,
        take the dedupe key, address a delay, encode, and ``before_enqueue``."""
        broker: Broker = self  # type: ignore[assignment]
        self._check_message(message)
        validate_send(message, delay)
        dedupe = _dedupe.dedupe_of(broker, message)
        held = processing_message()
        if held is not None and held.message_id == message.message_id:
            # A worker's retry of the message it runs is never a duplicate: the key may have
            # passed to a newer message since, and a retry must not be lost.
            dedupe = None
        canonical = q_name(message.queue_name)
        if delay is not None:
            message = message.copy(queue_name=dq_name(canonical), options={"eta": current_millis() + delay})
        self.encode(message)
        # Registers the queue (no I/O) so a worker sharing this broker consumes it.
        broker.declare_queue(canonical)
        try:
            broker.emit_before("enqueue", message, delay)
            # Encoded again: before_enqueue hooks may have added options (trace context).
            body = self.encode(message, warn=False)
            row = self._row(message, canonical, body)
        except BaseException as error:
            self._emit_enqueue_failed(message, delay, error)
            raise
        return _Send(message, delay, row, dedupe)

    def _check_message(self, message: Message[Any]) -> None:
        """A broker's own refusals (``PayloadError``), before anything else a send does."""

    def _end_send(self, send: _Send, first: str) -> Message[Any]:
        """``after_enqueue`` and the message returned, once the row is written (or deduped)."""
        broker: Broker = self  # type: ignore[assignment]
        message = send.message
        # after_enqueue sees the message before_enqueue saw, so hooks pair (a span ends).
        broker.emit_after("enqueue", message, send.delay)
        if first != message.message_id:
            logger.debug(
                "message %s for actor %r is a duplicate of %s (dedupe key held); nothing written",
                message.message_id,
                message.actor_name,
                first,
            )
            return message.copy(message_id=first)
        return message

    def encode(self, message: Message[Any], *, warn: bool = True) -> bytes:
        """The encoded message, or ``PayloadError`` if it cannot be encoded or is over the limit."""
        try:
            body = message.encode()
        except Exception as error:
            raise PayloadError(
                f"{_where(message)} cannot be encoded: {error}; send only JSON-serialisable arguments "
                "(IDs, strings, numbers), not objects"
            ) from error
        if self.payload_limit_bytes is not None and len(body) > self.payload_limit_bytes:
            raise PayloadError(
                f"{_where(message)} is {len(body)} bytes, over payload_limit_bytes={self.payload_limit_bytes}; "
                "send IDs and load the record in the actor"
            )
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

    def _row(self, message: Message[Any], canonical: str, body: bytes) -> Row:
        """The row's columns; ``queue_name`` is the queue the message was sent to (``.DQ`` when delayed:
        each broker readdresses a delayed row to the queue itself, as its delays wait in Postgres)."""
        return Row(
            queue_name=message.queue_name,
            message_id=message.message_id,
            actor_name=message.actor_name,
            body=body,
            priority=message.options.get("broker_priority"),
            eta_ms=message.options.get("eta"),
        )

    def _insert(self, conn: psycopg.Connection[Any], row: Row) -> None:
        conn.execute(_sql.rendered(self.insert_query, self.schema), row)

    def _insert_deduped(self, conn: psycopg.Connection[Any], row: Row, key: str, window_ms: int) -> str:
        """Write the row unless another message holds ``key`` (see :func:`dramatiq_reliable.dedupe.insert_row`)."""
        return _dedupe.insert_row(conn, _sql.rendered(self.insert_dedupe_query, self.schema), row, key, window_ms)

    def _written(self, row: Row) -> None:
        """The row was written (committed in autocommit, else pending the caller's commit): a
        broker whose consumers run in this process may wake them."""

    def _write_held(self, conn: psycopg.Connection[Any], message: Message[Any], row: Row) -> bool:
        """Write a worker's send of the message it holds some other way (True: done)."""
        return False

    def _worker_gave_up(self, message: Message[Any]) -> None:
        """A send made in a worker could not be written: keep the message being processed from its ack.

        Dramatiq swallows exceptions raised by after-hooks (where retries are sent) and then
        acks the message.  Failing it instead nacks it, and the broker keeps the nacked message
        (``.XQ``, and a dead letter when ``DeadLetters`` runs): losing a retry quietly is the one
        outcome never allowed.
        """
        processing = processing_message()
        if processing is not None:
            processing.fail()
            logger.critical(
                "could not write message %s to the %s from a worker; failed message %s instead so it is kept "
                "(dead letters, .XQ) rather than acked away",
                message.message_id,
                self.table,
                processing.message_id,
            )

    def _write(self, message: Message[Any], row: Row, dedupe: tuple[str, int] | None = None) -> str:
        """Write the row; the id of the message sent (another one's when ``dedupe``'s key was held)."""
        conn = joinable_connection(self.database, actor_name=message.actor_name)
        if conn is not None:
            return self._execute(conn, row, message, dedupe)
        return self._write_unbound(message, row, dedupe, isinstance(threading.current_thread(), WorkerThread))

    def _write_unbound(self, message: Message[Any], row: Row, dedupe: tuple[str, int] | None, in_worker: bool) -> str:
        """Commit the row on its own on a pooled connection (or ``NotBound`` under ``on_unbound="error"``)."""
        self._check_unbound(message, in_worker)
        attempts = _Attempts(self.worker_write_timeout_ms if in_worker else 0)
        while True:
            try:
                with self.database.autocommit(timeout_ms=attempts.next_timeout_ms()) as pooled:
                    if in_worker and self._write_held(pooled, message, row):
                        return message.message_id
                    return self._execute(pooled, row, message, dedupe)
            except (OutboxWriteError, PoolTimeout, psycopg.OperationalError) as error:
                time.sleep(self._pause_or_raise(attempts, error, message, row, in_worker))

    def _check_unbound(self, message: Message[Any], in_worker: bool) -> None:
        if self.on_unbound == "error" and not in_worker:
            raise NotBound(
                f"send() of actor {message.actor_name!r} outside a transaction; wrap it in "
                "'with broker.transaction():' or 'with bind(conn):', or build the broker with on_unbound='autocommit'"
            )

    def _pause_or_raise(
        self, attempts: _Attempts, error: BaseException, message: Message[Any], row: Row, in_worker: bool
    ) -> float:
        """How long to wait before the next autocommit attempt, or raise when it is over.

        A failure during COMMIT may leave the row written: the retry then adds a second row with
        the same message_id, which consumers dedupe (at least once, never zero).  A worker keeps
        trying for ``worker_write_timeout_ms``, since the message it runs would otherwise be
        acked without its follow-up; elsewhere the send is tried twice (a connection that died
        in the pool) and the caller sees the error.  Shared by the sync and async paths.
        """
        cause = error.__cause__ if isinstance(error, OutboxWriteError) else error
        transient = isinstance(cause, (psycopg.OperationalError, PoolTimeout))
        if not transient or attempts.over():
            if in_worker:
                self._worker_gave_up(message)
            if isinstance(error, OutboxWriteError):
                raise error
            raise self._write_error(row, error) from error
        pause = attempts.pause()
        if pause:
            logger.warning(
                "%s write of message %s failed (%s); retrying in %.2fs",
                self.table,
                message.message_id,
                type(cause).__name__,
                pause,
            )
        return pause

    async def _write_async(self, message: Message[Any], row: Row, dedupe: tuple[str, int] | None) -> str:
        """:meth:`_write` for async code: which transaction is chosen the same way; only how the
        statement runs differs (see :mod:`dramatiq_reliable.async_sending`)."""
        async_conn = bound_async_connection()
        if async_conn is not None:
            check_joinable(async_conn, self.database, actor_name=message.actor_name)
            return await self._execute_async(async_conn, row, message, dedupe)
        conn = bound_connection() or ambient_connection(self.database)
        if conn is not None:
            check_joinable(conn, self.database, actor_name=message.actor_name)
            # A sync connection (an async actor's job connection): in a thread, so the loop
            # shared by the worker's async actors is not blocked for the round trip.
            return await asyncio.to_thread(self._execute, conn, row, message, dedupe)
        if _processing.get() is not None:
            # An async actor's send (its context carries the worker's message): a worker's send,
            # on the worker's sync pool in a thread.  Dramatiq's loop then holds no async pool,
            # which it could not close (it stops that loop without cancelling its tasks).
            return await asyncio.to_thread(self._write_unbound, message, row, dedupe, True)
        self._check_unbound(message, in_worker=False)
        attempts = _Attempts(0)
        while True:
            try:
                async with self.database.async_autocommit(timeout_ms=attempts.next_timeout_ms()) as pooled:
                    return await self._execute_async(pooled, row, message, dedupe)
            except (OutboxWriteError, PoolTimeout, psycopg.OperationalError) as error:
                await asyncio.sleep(self._pause_or_raise(attempts, error, message, row, in_worker=False))

    async def _execute_async(
        self,
        conn: psycopg.AsyncConnection[Any],
        row: Row,
        message: Message[Any],
        dedupe: tuple[str, int] | None,
    ) -> str:
        if not self._checked_schema or (dedupe is not None and not self._checked_dedupe):
            # Once per broker, on a sync pooled connection: the check is of the schema, not of
            # this connection.
            await asyncio.to_thread(self._check_schemas_pooled, dedupe is not None)
        with self._write_errors(row):
            if dedupe is None:
                await conn.execute(_sql.rendered(self.insert_query, self.schema), row)
                first = message.message_id
            else:
                key, window_ms = dedupe
                cursor = conn.cursor(row_factory=dict_row)
                await cursor.execute(
                    _sql.rendered(self.insert_dedupe_query, self.schema),
                    {**row, "dedupe_key": key, "window_ms": window_ms},
                )
                found = await cursor.fetchone()
                assert found is not None  # INSERT ... ON CONFLICT DO UPDATE returns its row
                first = str(found["message_id"])
        self._written(row)
        return first

    def _check_schemas_pooled(self, dedupe: bool) -> None:
        with self.database.autocommit() as conn:
            self._check_schemas(conn, dedupe)

    def _execute(
        self,
        conn: psycopg.Connection[Any],
        row: Row,
        message: Message[Any],
        dedupe: tuple[str, int] | None,
    ) -> str:
        self._check_schemas(conn, dedupe is not None)
        with self._write_errors(row):
            if dedupe is None:
                self._insert(conn, row)
                first = message.message_id
            else:
                # One statement: the key and the row commit together, in autocommit too.
                first = self._insert_deduped(conn, row, *dedupe)
        self._written(row)
        return first

    def _check_schemas(self, conn: psycopg.Connection[Any], dedupe: bool) -> None:
        if not self._checked_schema:
            self._check_schema(conn)
        if dedupe:
            self._check_dedupe_schema(conn)

    @contextlib.contextmanager
    def _write_errors(self, row: Row) -> Iterator[None]:
        """The errors of a row's statement as ours (sync and async paths)."""
        try:
            yield
        except psycopg.errors.UndefinedTable as error:
            self._checked_schema = False
            raise SchemaNotReady(
                f"table {self.schema!r}.{self.table!r} does not exist; run 'dramatiq-reliable migrate'"
            ) from error
        except psycopg.Error as error:
            raise self._write_error(row, error) from error

    def _check_dedupe_schema(self, conn: psycopg.Connection[Any]) -> None:
        if self._checked_dedupe:
            return
        with self._check_lock:
            try:
                _schema.ensure_ready(conn, schema=self.schema, required=_schema.DEDUPE_VERSION, feature="send dedupe")
            except psycopg.Error as error:
                raise OutboxWriteError(
                    f"could not check the send dedupe schema {self.schema!r}: {type(error).__name__}: "
                    f"{redact(first_line(error))}; check the database connection"
                ) from error
            self._checked_dedupe = True

    def _write_error(self, row: Row, error: BaseException) -> OutboxWriteError:
        return OutboxWriteError(
            f"could not write message {row['message_id']!r} for queue {row['queue_name']!r} to the {self.table} in "
            f"schema {self.schema!r}: {type(error).__name__}: {redact(first_line(error))}; the message was not "
            f"sent, {self._write_fix(error)}"
        )

    def _write_fix(self, error: BaseException) -> str:
        """What to do about a failed write, from what Postgres said: most failures are the
        connection's, but a person on call must not be sent to the network for a read-only
        transaction, a missing grant or a wait on another transaction."""
        errors = psycopg.errors
        if isinstance(error, errors.ReadOnlySqlTransaction):
            return (
                "as the transaction is read-only (a standby, or SET TRANSACTION READ ONLY): send from a read-write "
                "transaction on the primary"
            )
        if isinstance(error, errors.InsufficientPrivilege):
            return (
                f"as the database role may not write to {self.schema}.{self.table}: grant it USAGE on the schema "
                "and INSERT on the table (or send as the role that ran 'dramatiq-reliable migrate')"
            )
        if isinstance(error, (errors.LockNotAvailable, errors.QueryCanceled)):
            return (
                "as the statement was stopped while it ran or waited (lock_timeout, statement_timeout or a cancel; "
                "with a dedupe_key, another transaction may hold the same key and not have committed yet); retry "
                "the transaction, and keep transactions that send short"
            )
        if isinstance(error, (errors.DeadlockDetected, errors.SerializationFailure)):
            return (
                "as Postgres rolled the transaction back to resolve a conflict with another one; retry the transaction"
            )
        return "check the database connection and retry the transaction"

    def _check_schema(self, conn: psycopg.Connection[Any]) -> None:
        with self._check_lock:
            try:
                _schema.ensure_ready(conn, schema=self.schema, required=self.required_version, feature=self.table)
            except psycopg.Error as error:
                raise OutboxWriteError(
                    f"could not check the {self.table} schema {self.schema!r}: {type(error).__name__}: "
                    f"{redact(first_line(error))}; check the database connection"
                ) from error
            self._checked_schema = True

    def _emit_enqueue_failed(self, message: Message[Any], delay: int | None, error: BaseException) -> None:
        # Middleware that opened something in before_enqueue (a span) may define
        # after_enqueue_failed to close it.
        broker: Broker = self  # type: ignore[assignment]
        for middleware in reversed(broker.middleware):
            hook = getattr(middleware, "after_enqueue_failed", None)
            if hook is None:
                continue
            try:
                hook(broker, message, delay, exception=error)
            except Exception:
                logger.exception("after_enqueue_failed of %r failed", middleware)


_processing: contextvars.ContextVar[MessageProxy | None] = contextvars.ContextVar(
    "dramatiq_reliable_processing", default=None
)


def processing_message() -> MessageProxy | None:
    """The message the current worker thread is processing (``None`` elsewhere)."""
    return _processing.get() if isinstance(threading.current_thread(), WorkerThread) else None


class TrackProcessing(Middleware):
    """Remembers the message a worker thread processes, so a send it cannot write keeps that message.

    Added first by every Postgres-backed broker, so its after-hooks run last: the message stays
    known while the other middleware (the retries above all) send from their after-hooks.  At
    boot it warns when the pool is smaller than the worker needs.
    """

    def after_worker_boot(self, broker: Broker, worker: Any) -> None:
        database = getattr(broker, "database", None)
        threads = int(getattr(worker, "worker_threads", 0) or 0)
        size = int(getattr(getattr(database, "pool", None), "max_size", 0) or 0)
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

    @staticmethod
    def install(broker: Broker) -> None:
        """Add the tracker first in ``broker``'s middleware list."""
        tracker = TrackProcessing()
        if broker.middleware:
            broker.add_middleware(tracker, before=type(broker.middleware[0]))
        else:
            broker.add_middleware(tracker)
