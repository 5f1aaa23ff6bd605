"""The transaction that ``actor.send()`` writes into: a connection bound to the current context.

Binding is a :class:`contextvars.ContextVar`, so it follows the code that set it: each thread
and each asyncio task sees its own binding, and a binding never leaks into the next message a
worker thread processes.  Everything that writes on behalf of a job (the outbox broker, the
``Idempotency`` middleware) reads the same binding, which is what makes "consume, write, produce"
one transaction.

What can be bound:

* a psycopg 3 ``Connection`` (``with bind(conn):``) or ``AsyncConnection`` (its sends are
  ``await send_async(...)``; a plain ``send()`` inside an async binding is refused, because it
  would have to commit on its own);
* a SQLAlchemy ``Session`` or ``Connection`` on the psycopg driver (``with bind(session):``), and
  an ``AsyncSession`` or ``AsyncConnection`` (``async with bind(session):``): the row commits or
  rolls back with the session's transaction (see :mod:`dramatiq_reliable.sqlalchemy`).

A psycopg2 connection is refused: every statement of ours is psycopg 3 (its ``sql`` module, its
row factories, its pipeline), and a half-supported second driver is how a send ends up in the
wrong transaction.  Django 4.2+ and SQLAlchemy 2 both run on psycopg 3 (``pip install psycopg``).

Where nothing is bound, the send path asks the **ambient sources** (:func:`register_ambient`):
integrations that can see a transaction the caller opened without binding it (Django's
``transaction.atomic()``, a SQLAlchemy session bound by event).  A source returns the connection
to join, or ``None`` when there is no transaction of its kind, or raises ``NotBound`` for one it
sees but must not join; a send therefore never commits on its own inside a transaction we can
detect.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg.pq import TransactionStatus

from .errors import ConfigurationError, NotBound

if TYPE_CHECKING:
    from .database import Database

# ambient_connection, bound_async_connection and check_joinable are for the send paths only.
__all__ = ["AmbientSource", "bind", "bound_connection", "bound_transaction", "register_ambient"]

AnyConnection = psycopg.Connection[Any] | psycopg.AsyncConnection[Any]

_bound: contextvars.ContextVar[AnyConnection | None] = contextvars.ContextVar(
    "dramatiq_reliable_connection", default=None
)

#: Why what was bound can no longer be joined (``None``: it can): set with the binding of a
#: SQLAlchemy session or connection, whose psycopg connection goes back to SQLAlchemy's pool
#: when the session's transaction ends, while the binding may still be in force.
Guard = Callable[[], "str | None"]
_guard: contextvars.ContextVar[Guard | None] = contextvars.ContextVar("dramatiq_reliable_guard", default=None)


def _guard_of(target: object) -> Guard | None:
    if type(target).__module__.startswith("sqlalchemy."):
        from .sqlalchemy import connections as _sa

        return _sa.binding_guard(target)
    return None


_PSYCOPG2 = (
    "psycopg2 connections cannot be bound: dramatiq-reliable writes with psycopg 3; "
    "install psycopg ('pip install psycopg[binary]'): Django >= 4.2 uses it on its own, and SQLAlchemy "
    "takes it with a 'postgresql+psycopg://' URL"
)


def _check_open(conn: AnyConnection) -> AnyConnection:
    if conn.closed or conn.broken:
        raise ConfigurationError("bind() got a closed connection; bind an open psycopg connection")
    if conn.info.transaction_status == TransactionStatus.INERROR:
        raise ConfigurationError(
            "bind() got a connection whose transaction failed (an earlier statement raised); roll it back first"
        )
    return conn


def _unwrap(target: object) -> AnyConnection:
    """The psycopg connection behind ``target`` (sync path: no awaiting)."""
    if isinstance(target, (psycopg.Connection, psycopg.AsyncConnection)):
        return _check_open(target)
    module = type(target).__module__
    if module.startswith("sqlalchemy."):
        from .sqlalchemy import connections as _sa

        return _check_open(_sa.driver_connection(target))
    if module.startswith("psycopg2"):
        raise ConfigurationError(_PSYCOPG2)
    raise ConfigurationError(
        f"bind() needs a psycopg connection or a SQLAlchemy Session/Connection, got {type(target).__name__!r}; "
        "Django users need no bind() inside transaction.atomic() with 'dramatiq_reliable.django' installed"
    )


class bind:  # used as a function: with bind(conn): ...
    """Make ``actor.send()`` write its rows on ``target``'s transaction inside this block.

    The rows become visible when that transaction commits and vanish if it rolls back;
    committing stays the caller's job.  Bindings nest: the innermost one wins and the outer one
    is restored on exit.  ``target`` is a psycopg 3 connection (sync or async) or a SQLAlchemy
    ``Session``/``Connection`` (``with``) or ``AsyncSession``/``AsyncConnection`` (``async with``).

    >>> with conn.transaction(), bind(conn):   # doctest: +SKIP
    ...     conn.execute("INSERT INTO orders ...")
    ...     send_receipt.send(order_id)

    Binding a closed connection, one in a failed transaction, or a psycopg2 connection raises
    :class:`~dramatiq_reliable.ConfigurationError` naming the fix; nothing is bound.
    """

    def __init__(self, target: object) -> None:
        self._target = target
        self._tokens: list[tuple[contextvars.Token[AnyConnection | None], contextvars.Token[Guard | None]]] = []

    def __enter__(self) -> Any:
        conn = _unwrap(self._target)
        self._tokens.append((_bound.set(conn), _guard.set(_guard_of(self._target))))
        return conn

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self._reset()

    def _reset(self) -> None:
        bound, guard = self._tokens.pop()
        _guard.reset(guard)
        _bound.reset(bound)

    async def __aenter__(self) -> Any:
        module = type(self._target).__module__
        if module.startswith("sqlalchemy."):
            from .sqlalchemy import connections as _sa

            conn = _check_open(await _sa.async_driver_connection(self._target))
        else:
            conn = _unwrap(self._target)
        self._tokens.append((_bound.set(conn), _guard.set(_guard_of(self._target))))
        return conn

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._reset()


def bound_connection() -> psycopg.Connection[Any] | None:
    """The sync connection bound to the current context, or ``None`` (nothing, or an async one, bound)."""
    conn = _bound.get()
    return conn if isinstance(conn, psycopg.Connection) else None


def bound_async_connection() -> psycopg.AsyncConnection[Any] | None:
    """The async connection bound to the current context, or ``None``."""
    conn = _bound.get()
    return conn if isinstance(conn, psycopg.AsyncConnection) else None


@contextlib.contextmanager
def bound_transaction(database: Database) -> Iterator[psycopg.Connection[Any]]:
    """A pooled connection in a transaction, bound for ``send()``: what ``broker.transaction()`` opens.

    Shared by every broker whose sends are rows (``OutboxBroker``, ``PostgresBroker``): it commits
    when the block exits normally and rolls back when it raises.
    """
    with database.connection() as conn, conn.transaction(), bind(conn):
        yield conn


# -- joining a bound connection ------------------------------------------------------------------


def check_joinable(conn: AnyConnection, database: Database | None, *, actor_name: str) -> None:
    """Refuse a send that would not land in the caller's transaction, before any statement.

    No round trip: everything checked is known to the client.  A connection in autocommit with
    no transaction open would commit the row on its own (the outbox's whole point lost); one in
    a failed transaction would refuse the insert; one on another database than the broker's
    (``database``; ``None`` skips that check) would leave the row where no relay or worker looks.
    """
    where = f"send() of actor {actor_name!r}"
    guard = _guard.get()
    reason = guard() if guard is not None and conn is _bound.get() else None
    if reason is not None:
        raise NotBound(f"{where} {reason}")
    if conn.closed or conn.broken:
        raise NotBound(f"{where} on a bound connection that is closed; bind an open connection")
    status = conn.info.transaction_status
    if status == TransactionStatus.INERROR:
        raise NotBound(
            f"{where} in a failed transaction (an earlier statement raised); roll back and retry the transaction"
        )
    if conn.autocommit and status == TransactionStatus.IDLE:
        raise NotBound(
            f"{where} on a bound connection in autocommit with no transaction open: the message would commit "
            "on its own; open one first ('with conn.transaction():')"
        )
    if database is None:
        return
    dbname, port = database.identity()
    if (dbname is not None and conn.info.dbname != dbname) or (port is not None and conn.info.port != port):
        raise NotBound(
            f"{where} on a connection to database {conn.info.dbname!r} (port {conn.info.port}), but the broker "
            f"uses {dbname!r} (port {port}); bind a connection to the broker's database"
        )


def joinable_connection(database: Database | None, *, actor_name: str) -> psycopg.Connection[Any] | None:
    """The transaction a sync ``send()`` writes in: the bound one, else an ambient one, checked.

    ``None`` when there is none (the caller's ``on_unbound`` rule applies).  Inside an async
    binding a sync send is refused: it could only commit on its own.  ``database=None`` (a
    broker with no Postgres of its own) asks no ambient source and checks no database identity.
    """
    conn = bound_connection()
    if conn is None and bound_async_connection() is not None:
        raise NotBound(
            f"send() of actor {actor_name!r} inside an async binding: it would commit on its own, "
            "outside that transaction; use 'await send_async(actor, ...)' in async code"
        )
    if conn is None and database is not None:
        # A transaction the caller opened without binding it (Django's atomic(), ...).
        conn = ambient_connection(database)
    if conn is not None:
        check_joinable(conn, database, actor_name=actor_name)
    return conn


# -- ambient transactions ------------------------------------------------------------------------

#: A function that, given the broker's database, returns the connection of a transaction the
#: caller opened without binding it, ``None`` when there is none of its kind, or raises
#: ``NotBound`` for one it sees but must not join.
AmbientSource = Callable[["Database"], "psycopg.Connection[Any] | None"]

_sources: list[AmbientSource] = []
_sources_lock = threading.Lock()


def register_ambient(source: AmbientSource) -> Callable[[], None]:
    """Ask ``source`` for a transaction to join whenever a send finds nothing bound.

    Returns a function that removes it again (registering the same source twice is a no-op).
    Integrations call this once (Django's ``AppConfig.ready()``); applications rarely need to.
    """
    if not callable(source):
        raise ConfigurationError(f"register_ambient() needs a callable, got {type(source).__name__!r}")
    with _sources_lock:
        if source not in _sources:
            _sources.append(source)

    def unregister() -> None:
        with _sources_lock, contextlib.suppress(ValueError):
            _sources.remove(source)

    return unregister


def ambient_connection(database: Database) -> psycopg.Connection[Any] | None:
    """The connection of a transaction an ambient source sees, or ``None``; ``NotBound`` propagates."""
    for source in tuple(_sources):
        conn = source(database)
        if conn is not None:
            return conn
    return None
