"""A broker for users' unit tests: sends kept in memory, run by ``drain()`` in the test's own thread.

Code under test runs unchanged: actors are declared against it, ``broker.transaction()`` and
:func:`~dramatiq_reliable.bind` work, and a send made inside a transaction follows the outbox's
rule that a rolled-back send never happened.  A send joins a transaction the way an outbox row
does and is delivered only once that transaction committed:

* inside ``broker.transaction()`` of a broker built with ``database=``, or inside ``bind(conn)``
  of a real psycopg connection, the send waits for that Postgres transaction (its id is taken
  with ``pg_current_xact_id()`` and its fate read with ``pg_xact_status()``, so commits and
  rollbacks anywhere, Idempotency's job transaction included, decide it);
* inside ``broker.transaction()`` of a broker without a database, the block is the transaction:
  its sends are delivered when it exits normally and dropped when it raises;
* anywhere else the send is delivered at once, as ``on_unbound="autocommit"`` would.

>>> broker = InMemoryBroker()
>>> with broker.transaction():                         # doctest: +SKIP
...     send_receipt.send(42)
>>> broker.drain()                                     # doctest: +SKIP
1
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import threading
from collections.abc import Iterator
from typing import Any, NoReturn, cast

import psycopg
from dramatiq.asyncio import get_event_loop_thread
from dramatiq.broker import MessageProxy
from dramatiq.brokers.stub import StubBroker
from dramatiq.common import current_millis, dq_name, q_name
from dramatiq.message import Message
from dramatiq.middleware import AsyncIO, Middleware, SkipMessage
from psycopg.rows import dict_row

from .. import _sql
from .._checks import check_int
from ..binding import bound_transaction, joinable_connection
from ..database import Database, DatabaseLike
from ..errors import ConfigurationError, PayloadError
from ..sending import validate_send

__all__ = ["InMemoryBroker"]

#: How many jobs one ``drain()`` runs before it decides the jobs send each other for ever.
DEFAULT_MAX_JOBS = 10_000


def describe(message: Message[Any]) -> str:
    """``actor(1, 'a', key=2)``: a message as a call, for assertion messages."""
    arguments = [repr(arg) for arg in message.args]
    arguments += [f"{name}={value!r}" for name, value in message.kwargs.items()]
    return f"{message.actor_name}({', '.join(arguments)})"


@dataclasses.dataclass(frozen=True)
class _Held:
    """A send waiting for the Postgres transaction it joined (``xid``) to end."""

    message: Message[Any]
    xid: str
    #: where to read the transaction's fate: the bound connection's server, by its parameters
    #: (credentials included, so never shown)
    conninfo: str


class _Block:
    """The sends of one ``transaction()`` block of a broker without a database."""

    def __init__(self, broker: InMemoryBroker) -> None:
        self.broker = broker
        self.sends: list[Message[Any]] = []


_current_block: contextvars.ContextVar[_Block | None] = contextvars.ContextVar(
    "dramatiq_reliable_stub_block", default=None
)


class _NoConnection:
    """What ``transaction()`` yields without a database: usable for sends, refusing SQL with the fix."""

    def __getattr__(self, name: str) -> NoReturn:
        raise ConfigurationError(
            f"InMemoryBroker.transaction() has no database connection, so its {name!r} cannot be used; build "
            "the broker with database='postgresql://...' (the reliable_postgres_broker fixture does) to run SQL "
            "in the transaction"
        )


class InMemoryBroker(StubBroker):
    """Dramatiq's ``StubBroker`` with the outbox's transaction rule and a synchronous :meth:`drain`.

    ``database`` (optional) is where ``transaction()`` opens its transactions; without it the
    block itself is the transaction (see the module docstring).  ``max_jobs`` bounds one
    :meth:`drain`, so jobs that keep sending each other fail the test instead of hanging it.

    :attr:`sent` lists every message delivered (its transaction committed), in order, whether a
    drain ran it yet or not; the assertions (:func:`~dramatiq_reliable.testing.assert_enqueued`)
    read it.  Dramatiq's own ``Worker`` and ``join()`` still work on this broker.
    """

    def __init__(
        self,
        middleware: list[Middleware] | None = None,
        *,
        database: DatabaseLike | None = None,
        max_jobs: int = DEFAULT_MAX_JOBS,
    ) -> None:
        self.max_jobs = check_int("max_jobs", max_jobs, minimum=1, fix="e.g. max_jobs=10_000")
        self.database: Database | None = None if database is None else Database.of(database)
        super().__init__(middleware)
        #: every message delivered, in the order it was delivered
        self.sent: list[Message[Any]] = []
        self._held: list[_Held] = []
        self._lock = threading.Lock()
        # autocommit connections that read the fate of held sends' transactions, by conninfo
        self._readers: dict[str, psycopg.Connection[Any]] = {}
        # the AsyncIO middleware whose event loop drain() started (see _start_event_loop)
        self._event_loop: AsyncIO | None = None

    # -- sending -----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def transaction(self) -> Iterator[psycopg.Connection[Any]]:
        """A transaction whose sends are delivered when it commits (see the module docstring)."""
        if self.database is not None:
            with bound_transaction(self.database) as conn:
                yield conn
            return
        block = _Block(self)
        token = _current_block.set(block)
        try:
            yield cast(psycopg.Connection[Any], _NoConnection())
        except BaseException:
            _current_block.reset(token)
            raise  # the block rolled back: its sends never happened
        _current_block.reset(token)
        for message in block.sends:
            self._deliver(message)

    def enqueue(self, message: Message[Any], *, delay: int | None = None) -> Message[Any]:
        """Check ``message`` as the Postgres brokers do, then deliver it or hold it for its transaction."""
        validate_send(message, delay)
        try:
            message.encode()
        except Exception as error:
            raise PayloadError(
                f"message {message.message_id!r} for actor {message.actor_name!r} cannot be encoded: {error}; "
                "send only JSON-serialisable arguments (IDs, strings, numbers), not objects"
            ) from error
        canonical = q_name(message.queue_name)
        self.declare_queue(canonical)
        if delay is not None:
            message = message.copy(queue_name=dq_name(canonical), options={"eta": current_millis() + delay})
        self.emit_before("enqueue", message, delay)
        # The Postgres brokers' choice of transaction and their refusals, so a test sees what
        # production would.
        conn = joinable_connection(self.database, actor_name=message.actor_name)
        block = self._block()
        if conn is not None:
            self._hold(conn, message)
        elif block is not None:
            block.sends.append(message)
        else:
            self._deliver(message)
        self.emit_after("enqueue", message, delay)
        return message

    def _block(self) -> _Block | None:
        """The current ``transaction()`` block, if it is this broker's (another broker's block is not our transaction)."""
        block = _current_block.get()
        return block if block is not None and block.broker is self else None

    def _hold(self, conn: psycopg.Connection[Any], message: Message[Any]) -> None:
        row = (
            conn.cursor(row_factory=dict_row).execute(_sql.query("stub_transaction_id", _sql.DEFAULT_SCHEMA)).fetchone()
        )
        assert row is not None
        with self._lock:
            self._held.append(_Held(message, str(row["xid"]), _conninfo_of(conn)))

    def _deliver(self, message: Message[Any]) -> None:
        with self._lock:
            self.sent.append(message)
        self.queues[message.queue_name].put(message.encode())

    # -- held sends ----------------------------------------------------------------------------------

    def settle(self) -> None:
        """Deliver the held sends whose transaction committed and drop those whose transaction rolled back.

        Called by :meth:`drain`, :meth:`join` and the assertions; a send whose transaction is still
        open stays held, as an uncommitted outbox row stays invisible to the relay.
        """
        with self._lock:
            held, self._held = self._held, []
        waiting: list[_Held] = []
        for send in held:
            fate = self._fate(send)
            if fate == "committed":
                self._deliver(send.message)
            elif fate == "in progress":
                waiting.append(send)
        with self._lock:
            self._held[:0] = waiting

    @property
    def held(self) -> list[Message[Any]]:
        """The sends waiting for their transaction to end (a database's, or the current ``transaction()`` block)."""
        block = self._block()
        with self._lock:
            return [send.message for send in self._held] + (list(block.sends) if block is not None else [])

    def _fate(self, send: _Held) -> str | None:
        reader = self._readers.get(send.conninfo)
        if reader is None or reader.closed:
            reader = self._readers[send.conninfo] = psycopg.connect(send.conninfo, autocommit=True)
        query = _sql.query("stub_transaction_status", _sql.DEFAULT_SCHEMA)
        row = reader.cursor(row_factory=dict_row).execute(query, {"xid": send.xid}).fetchone()
        return None if row is None else cast("str | None", row["status"])

    # -- running jobs --------------------------------------------------------------------------------

    def drain(self) -> int:
        """Run every delivered job, and the jobs they send, in the calling thread; the number run.

        Jobs run one at a time, queue by queue in the order each queue got them, with the broker's
        middleware around each as a worker runs it; delayed jobs (retries included) run once no
        other job waits, without waiting for their delay.  The first job that raises stops the
        drain: its exception is raised again here, with a note naming the message, after the
        middleware saw it (so a retry it scheduled stays queued for the next drain).
        """
        self._start_event_loop()
        ran = 0
        while True:
            self.settle()
            message = self._next()
            if message is None:
                return ran
            if ran >= self.max_jobs:
                raise AssertionError(
                    f"drain() ran {ran} jobs and more keep coming (next: {describe(message)}); the jobs send "
                    "each other without end, or build the broker with a larger max_jobs="
                )
            ran += 1
            self._run(message)

    def _start_event_loop(self) -> None:
        """Async actors run on the event loop of Dramatiq's ``AsyncIO`` middleware, which a worker starts at
        boot: here ``drain()`` is the worker, so the first drain starts it (unless one runs already) and
        :meth:`close` stops it."""
        if self._event_loop is not None or get_event_loop_thread() is not None:
            return
        for middleware in self.middleware:
            if isinstance(middleware, AsyncIO):
                middleware.before_worker_boot(self, None)  # type: ignore[no-untyped-call]
                self._event_loop = middleware
                return

    def _next(self) -> Message[Any] | None:
        """The next job: the first waiting in a queue, else the first delayed one (time does not pass in a test)."""
        for delayed in (False, True):
            for name, queue in list(self.queues.items()):
                if (name in self.delay_queues) != delayed or queue.empty():
                    continue
                data = queue.get_nowait()
                queue.task_done()
                message = Message.decode(data)
                return message.copy(queue_name=q_name(name)) if delayed else message
        return None

    def _run(self, message: Message[Any]) -> None:
        proxy = MessageProxy(message)
        failure: BaseException | None = None
        try:
            self.emit_before("process_message", proxy)
            result = None
            if not proxy.failed:
                result = self.get_actor(proxy.actor_name)(*proxy.args, **proxy.kwargs)
            self.emit_after("process_message", proxy, result=result)
        except SkipMessage as error:
            if proxy.failed:
                proxy.stuff_exception(error)
            self.emit_after("skip_message", proxy)
        except BaseException as error:
            failure = error
            proxy.stuff_exception(error)
            self.emit_after("process_message", proxy, exception=error)
        outcome = "nack" if proxy.failed else "ack"
        self.emit_before(outcome, proxy)
        if proxy.failed:
            self.dead_letters_by_queue[proxy.queue_name].append(proxy)
        self.emit_after(outcome, proxy)
        if failure is None and proxy.failed:
            failure = proxy._exception or AssertionError(
                f"{describe(message)} (message {message.message_id}) was failed by a middleware without an error"
            )
        if failure is not None:
            if hasattr(failure, "add_note"):  # Python 3.11+
                failure.add_note(f"raised by {describe(message)}, message {message.message_id}, during drain()")
            raise failure

    def reset(self) -> None:
        """Forget every send, held, queued or delivered, and the dead-lettered messages: a clean slate for the next test."""
        with self._lock:
            self._held.clear()
            self.sent.clear()
        self.flush_all()

    # -- Dramatiq's own test helpers, and closing -------------------------------------------------------

    def join(self, queue_name: str, *, timeout: int | None = None, fail_fast: bool | None = None) -> None:
        """Dramatiq's ``join``, after delivering the held sends whose transaction committed."""
        self.settle()
        super().join(queue_name, timeout=timeout, fail_fast=fail_fast)

    def close(self) -> None:
        """Stop the event loop a drain started, close the connections that read held sends' transactions,
        and the database this broker opened."""
        super().close()
        if self._event_loop is not None:
            self._event_loop.after_worker_shutdown(self, None)  # type: ignore[no-untyped-call]
            self._event_loop = None
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()
        if self.database is not None and self.database.owned:
            self.database.close()


def _conninfo_of(conn: psycopg.Connection[Any]) -> str:
    """The parameters ``conn`` was opened with (credentials included: kept in memory, never shown)."""
    options = {option.keyword.decode(): option.val.decode() for option in conn.pgconn.info if option.val is not None}
    return psycopg.conninfo.make_conninfo("", **options)
