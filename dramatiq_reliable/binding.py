"""The transaction that ``actor.send()`` writes into: a psycopg connection bound to the current context.

Binding is a :class:`contextvars.ContextVar`, so it follows the code that set it: each thread
and each asyncio task sees its own binding, and a binding never leaks into the next message a
worker thread processes.  Everything that writes on behalf of a job (the outbox broker, the
``Idempotency`` middleware) reads the same binding, which is what makes "consume, write, produce"
one transaction.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import psycopg

from .errors import ConfigurationError

if TYPE_CHECKING:
    from .database import Database

__all__ = ["bind", "bound_connection", "bound_transaction"]

_bound: contextvars.ContextVar[psycopg.Connection[Any] | None] = contextvars.ContextVar(
    "dramatiq_reliable_connection", default=None
)


@contextlib.contextmanager
def bind(conn: psycopg.Connection[Any]) -> Iterator[psycopg.Connection[Any]]:
    """Make ``actor.send()`` write its outbox rows on ``conn`` inside this block.

    The rows become visible to the relay when ``conn``'s transaction commits and vanish if it
    rolls back; committing stays the caller's job.  Bindings nest: the innermost one wins and
    the outer one is restored on exit.

    >>> with conn.transaction(), bind(conn):   # doctest: +SKIP
    ...     conn.execute("INSERT INTO orders ...")
    ...     send_receipt.send(order_id)

    SQLAlchemy users bind ``session.connection().connection.driver_connection``; Django users
    bind ``django.db.connection.connection`` inside ``transaction.atomic()`` (both with the
    psycopg 3 driver).
    """
    if not isinstance(conn, psycopg.Connection):
        hint = ""
        if isinstance(conn, psycopg.AsyncConnection):
            hint = "; async connections are not supported, bind a sync psycopg.Connection"
        elif hasattr(conn, "driver_connection") or hasattr(conn, "connection"):
            hint = "; pass the underlying psycopg connection (SQLAlchemy: .connection.driver_connection)"
        raise ConfigurationError(f"bind() needs a psycopg.Connection, got {type(conn).__name__!r}{hint}")
    if conn.closed:
        raise ConfigurationError("bind() got a closed connection; bind an open psycopg.Connection")
    token = _bound.set(conn)
    try:
        yield conn
    finally:
        _bound.reset(token)


def bound_connection() -> psycopg.Connection[Any] | None:
    """The connection bound to the current context, or ``None`` outside any binding."""
    return _bound.get()


@contextlib.contextmanager
def bound_transaction(database: Database) -> Iterator[psycopg.Connection[Any]]:
    """A pooled connection in a transaction, bound for ``send()``: what ``broker.transaction()`` opens.

    Shared by every broker whose sends are rows (``OutboxBroker``, ``PostgresBroker``): it commits
    when the block exits normally and rolls back when it raises.
    """
    with database.connection() as conn, conn.transaction(), bind(conn):
        yield conn
