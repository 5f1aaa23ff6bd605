"""Batches: children sent in the sender's transaction, one callback when the last child finishes.

**Sending.**  ``Batch(callback=report.message(...))`` names the message to send once every child
has finished.  ``batch.add(actor.message(...))`` sends a child in the transaction bound to the
caller (``broker.transaction()``, :func:`~dramatiq_reliable.bind`, or Django's ``atomic()``):
the batch's row, the child's membership and the child's message commit together or not at all.
A child sent with nothing bound is refused (:class:`~dramatiq_reliable.NotBound`): committed on
its own it could run, and the batch could fire, before the rest of the batch exists.  Children
may be added over several transactions while the batch is open; :meth:`Batch.seal` (or leaving
``with batch:``) closes it, and only a sealed batch fires, so it never completes between two adds.
A sealed batch with no children fires at once.

**Counting.**  The :class:`Batches` middleware marks each child finished in the child's own job
transaction (with ``Idempotency`` in transactional mode, the transaction that commits the
actor's writes and its key), and the child that finishes last writes the callback as a row of the
outbox or queue table in that same transaction: a crash before the commit loses neither the
count nor the callback, and a redelivered child finds its row counted already and does nothing.
With no job transaction (no ``Idempotency``, or its record mode) the count is a statement of
its own after the actor returns, and it fails closed: tried again while the worker holds the
message, then the message is failed into the dead letters instead of acked (see
``_failclosed``), so an outage never leaves the batch waiting for a child that ran.
See ``sql/migrations/0015_batches.sql`` for how 128 counter shards keep 8 threads off one hot
row while the last child still sees every other child's commit.

**Dying children.**  ``if_child_dies="fail"`` (the default): the batch finishes as ``failed``
once every child has finished, and ``on_failure`` (a message, optional) is sent instead of the
callback.  ``if_child_dies="continue"``: a dead child counts as finished and the callback runs.
A dead child is recorded in its own transaction when the worker gives up on it (its job
transaction rolled back).

The callback (and ``on_failure``) is stored encoded when the batch is created and later written
as a row by SQL: ``before_enqueue`` hooks (tracing, dedupe) do not run for it.
"""

from __future__ import annotations

import logging
import threading
import uuid
from types import TracebackType
from typing import Any, Literal

import dramatiq
import psycopg
from dramatiq.broker import Broker, MessageProxy
from dramatiq.common import q_name
from dramatiq.errors import ActorNotFound
from dramatiq.message import Message
from dramatiq.middleware import Middleware
from psycopg.rows import dict_row

from .. import _sql
from .._checks import check_choice, check_ms, check_text
from .._util import first_line, redact
from ..backing import backing_of
from ..binding import ambient_connection, bound_connection, check_joinable
from ..database import Database
from ..errors import ConfigurationError, DatabaseUnavailable, NotBound
from ..idempotency._connections import autocommit
from ..idempotency.context import send_with_commit
from ..outbox.wake import channel
from ._failclosed import DEFAULT_WRITE_TIMEOUT_MS, FailedClosed, dead_unrecorded, left_to_commit, write_until

__all__ = ["BATCH_OPTION", "Batch", "Batches", "IfChildDies"]

logger = logging.getLogger("dramatiq_reliable.workflows.batch")

#: The message option naming the batch a child belongs to (retries and replays keep it).
BATCH_OPTION = "batch_id"

IfChildDies = Literal["fail", "continue"]


def _target(broker: Broker, needed_by: str) -> tuple[Database, str, dict[str, str]]:
    backing = backing_of(broker, needed_by=needed_by)
    return backing.database, backing.schema, {"target": backing.sends_to, "channel": channel(backing.schema)}


def _declared(broker: Broker, message: object, name: str) -> Message[Any]:
    if not isinstance(message, Message):
        raise ConfigurationError(
            f"{name} must be a message, got {message!r}; pass actor.message(...) of a declared actor"
        )
    try:
        broker.get_actor(message.actor_name)
    except ActorNotFound:
        raise ConfigurationError(
            f"{name} is a message of actor {message.actor_name!r}, which is not declared on this broker; declare the "
            "actor (@dramatiq.actor) before building the batch"
        ) from None
    return message


class Batch:
    """A set of children and the one message to send when all of them have finished.

    Parameters:
      callback: ``actor.message(...)`` of a declared actor; sent once, after the last child.
      on_failure: ``actor.message(...)`` sent instead of the callback when a child died and
        ``if_child_dies="fail"``; ``None`` sends nothing (the batch is still marked ``failed``).
      if_child_dies: ``"fail"`` or ``"continue"`` (see the module docstring).
      broker: default ``dramatiq.get_broker()``; an ``OutboxBroker`` or a ``PostgresBroker``.
      id: the batch's id (default a new UUID); progress is read by it (:func:`batch_status`).

    >>> with broker.transaction(), Batch(callback=report.message(month)) as batch:  # doctest: +SKIP
    ...     for invoice in invoices:
    ...         batch.add(send_invoice.message(invoice.id))
    """

    def __init__(
        self,
        *,
        callback: Message[Any],
        on_failure: Message[Any] | None = None,
        if_child_dies: IfChildDies = "fail",
        broker: Broker | None = None,
        id: str | None = None,
    ) -> None:
        self.broker = broker if broker is not None else dramatiq.get_broker()
        self.callback = _declared(self.broker, callback, "callback")
        self.on_failure = None if on_failure is None else _declared(self.broker, on_failure, "on_failure")
        self.if_child_dies: IfChildDies = check_choice(
            "if_child_dies", if_child_dies, ("fail", "continue"), fix="'fail' fails the batch, 'continue' counts it"
        )
        self.id = (
            str(uuid.uuid4())
            if id is None
            else check_text("id", id, max_chars=200, fix="pass a short printable id, or none for a UUID")
        )
        self._database, self._schema, self._resend = _target(self.broker, "Batch")
        #: Connections whose current transaction holds this batch's row (checked by identity).
        self._created: set[int] = set()

    def _bound(self, what: str) -> psycopg.Connection[Any]:
        conn = bound_connection() or ambient_connection(self._database)
        if conn is None:
            raise NotBound(
                f"{what} batch {self.id!r} outside a transaction; a child committed alone could run and fire the "
                "batch before the rest exists: wrap the adds in broker.transaction() (or bind(conn))"
            )
        check_joinable(conn, self._database, actor_name=self.callback.actor_name)
        return conn

    def _create(self, conn: psycopg.Connection[Any]) -> None:
        failure = self.on_failure
        conn.execute(
            _sql.rendered("batch_create", self._schema),
            {
                "id": self.id,
                "if_child_dies": self.if_child_dies,
                "callback_message_id": self.callback.message_id,
                "callback_actor": self.callback.actor_name,
                "callback_queue": q_name(self.callback.queue_name),
                "callback_body": self.callback.encode(),
                "failure_message_id": None if failure is None else failure.message_id,
                "failure_actor": None if failure is None else failure.actor_name,
                "failure_queue": None if failure is None else q_name(failure.queue_name),
                "failure_body": None if failure is None else failure.encode(),
            },
        )

    def _statement(self, conn: psycopg.Connection[Any], name: str, params: dict[str, Any]) -> str:
        try:
            if id(conn) not in self._created:
                self._create(conn)
                self._created.add(id(conn))
            row = conn.cursor(row_factory=dict_row).execute(_sql.rendered(name, self._schema), params).fetchone()
        except psycopg.Error as error:
            raise DatabaseUnavailable(
                f"batch {self.id!r}: {type(error).__name__}: {redact(first_line(error))}; the transaction is "
                f"aborted, roll it back and retry (run 'dramatiq-reliable migrate' if batches are missing)"
            ) from error
        assert row is not None
        return str(row["status"])

    def add(self, message: Message[Any]) -> Message[Any]:
        """Send ``message`` as a child, in the caller's transaction; returns the message as sent.

        Raises ``NotBound`` with nothing bound and ``ConfigurationError`` for a sealed batch, a
        batch not visible in this transaction (created in one that rolled back), or a message
        that is not one of a declared actor.  Nothing is written when it raises.
        """
        _declared(self.broker, message, "a batch's child")
        conn = self._bound("adding a child to")
        status = self._statement(conn, "batch_add", {"batch_id": self.id, "message_id": message.message_id})
        if status == "sealed":
            raise ConfigurationError(f"batch {self.id!r} is sealed; start a new Batch for more children")
        if status == "cancelled":
            raise ConfigurationError(f"batch {self.id!r} was cancelled; start a new Batch for more children")
        if status == "unknown":
            raise ConfigurationError(
                f"batch {self.id!r} does not exist in this transaction (the one that created it rolled back, or has "
                "not committed); add its children in the transaction that creates it, or after that one commits"
            )
        if status == "duplicate":
            return message
        child = message.copy(options={**message.options, BATCH_OPTION: self.id})
        return self.broker.enqueue(child)

    def seal(self) -> str:
        """Close the batch to new children; it fires now if every child has finished (or it has none).

        Runs in the caller's transaction if one is bound, else in its own.  Returns what happened:
        ``"waiting"`` (children still running), ``"fired"`` or ``"failed"``.
        """
        params = {"batch_id": self.id, **self._resend}
        conn = bound_connection() or ambient_connection(self._database)
        if conn is not None:
            return self._statement(conn, "batch_seal", params)
        with self._database.connection() as own, own.transaction():
            return self._statement(own, "batch_seal", params)

    def __enter__(self) -> Batch:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        if kind is None:
            self.seal()


class Batches(Middleware):
    """Count each finished child of a :class:`Batch` and send the batch's callback after the last one.

    Add it after ``Idempotency`` (after-hooks run in reverse, so it then counts inside the job's
    transaction, before the commit).  A child run without a transaction bound (no ``Idempotency``
    in transactional mode) is counted in a transaction of its own right after the actor returns:
    the count and the callback are still exactly once, but a crash between the actor's own commit
    and the count runs that child again on redelivery.  That count fails closed: it is tried
    again for up to ``write_timeout_ms`` while the worker holds the message, then the message is
    failed into the dead letters (not acked, not counted dead); its replay counts it.

    Parameters:
      write_timeout_ms: how long a count on a connection of its own is tried again before the
        child's message is failed; default 30 s.

    >>> broker.add_middleware(Batches())  # doctest: +SKIP
    """

    def __init__(self, *, write_timeout_ms: int = DEFAULT_WRITE_TIMEOUT_MS) -> None:
        self.write_timeout_ms = check_ms(
            "write_timeout_ms", write_timeout_ms, minimum=1, fix="e.g. 30_000; past it the child's message is failed"
        )
        self._targets: dict[int, tuple[Database, str, dict[str, str]]] = {}
        self._lock = threading.Lock()
        self._failed_closed = FailedClosed()

    def _target_of(self, broker: Broker) -> tuple[Database, str, dict[str, str]]:
        with self._lock:
            if id(broker) not in self._targets:
                self._targets[id(broker)] = _target(broker, "Batches")
            return self._targets[id(broker)]

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any | None = None,
        exception: BaseException | None = None,
    ) -> None:
        # A message another hook failed without raising is nacked: its after_nack counts it dead.
        if exception is None and not message.failed and BATCH_OPTION in message.options:
            conn = bound_connection()
            what = f"batch {message.options[BATCH_OPTION]!r}"
            if conn is not None:
                try:
                    if not self._with_commit(broker, message, conn):
                        self._finish(broker, message, dead=False, conn=conn)
                except Exception as error:
                    if left_to_commit(conn):
                        raise  # the job's commit fails, and it is retried or dead-lettered
                    # The job would commit without its count: fail it, and Idempotency rolls it back.
                    self._failed_closed.fail(message, error, what=what, timeout_ms=None)
                return
            try:
                self._finish(broker, message, dead=False, conn=None)
            except Exception as error:
                # Dramatiq would log this and ack the message: the batch would wait for ever.
                self._failed_closed.fail(message, error, what=what, timeout_ms=self.write_timeout_ms)

    def _with_commit(self, broker: Broker, message: MessageProxy, conn: psycopg.Connection[Any]) -> bool:
        """Hand the count to ``Idempotency`` to send with the job's COMMIT; ``False`` if it runs no job here.

        Same transaction, same outcome as counting now, one round trip fewer per child: under 8
        worker threads the round trip, not the statement, is what a count costs.
        """
        _, schema, resend = self._target_of(broker)
        params = {"batch_id": message.options[BATCH_OPTION], "message_id": message.message_id, "dead": False, **resend}
        statement = psycopg.ClientCursor(conn).mogrify(_sql.rendered("batch_finish", schema), params)
        return send_with_commit(statement.encode(conn.info.encoding))

    def after_nack(self, broker: Broker, message: MessageProxy) -> None:
        # The worker gave up on it: its job transaction rolled back, so the death is recorded alone.
        if BATCH_OPTION in message.options and not self._failed_closed.take(message):
            try:
                self._finish(broker, message, dead=True, conn=None)
            except Exception as error:
                # Nacked already: nothing to fail.  The batch waits for it until its dead letter is replayed.
                dead_unrecorded(message, error, what=f"batch {message.options[BATCH_OPTION]!r}")

    def _finish(
        self, broker: Broker, message: MessageProxy, *, dead: bool, conn: psycopg.Connection[Any] | None
    ) -> str:
        database, schema, resend = self._target_of(broker)
        params = {"batch_id": message.options[BATCH_OPTION], "message_id": message.message_id, "dead": dead, **resend}
        query = _sql.rendered("batch_finish", schema)
        if conn is not None:
            # In the job's transaction: a failure aborts it, so the job's commit fails and it is retried.
            row = conn.cursor(row_factory=dict_row).execute(query, params).fetchone()
        else:

            def write() -> dict[str, Any] | None:
                with database.connection() as own, autocommit(own):
                    return own.cursor(row_factory=dict_row).execute(query, params).fetchone()

            what = f"batch {params['batch_id']!r}: counting child {message.message_id!r}"
            row = write_until(write, timeout_ms=self.write_timeout_ms, what=what)
        assert row is not None
        status = str(row["status"])
        logger.debug("batch %s: child %s -> %s", params["batch_id"], message.message_id, status)
        return status

    def before_worker_boot(self, broker: Broker, worker: Any) -> None:
        names = [type(m).__name__ for m in broker.middleware]
        if (
            "Idempotency" in names
            and self in broker.middleware
            and names.index("Idempotency") > broker.middleware.index(self)
        ):
            logger.warning(
                "Batches comes before Idempotency in the middleware list, so children are counted after their job "
                "commits; add Batches after Idempotency"
            )
