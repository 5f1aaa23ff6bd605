"""The psycopg connection under a SQLAlchemy session or connection: what ``bind()`` joins.

``bind(session)`` (sync) and ``async with bind(async_session)`` reach the psycopg 3 connection
under SQLAlchemy's pool: the outbox row is then one more statement of the session's
transaction, committed or rolled back with it (a ``begin_nested()`` savepoint included).

Every refusal happens before the session is touched where it can: the engine's driver is read
from its dialect, so binding a psycopg2, asyncpg or pg8000 session raises without beginning a
transaction on it.  A session bound to several engines is refused too: ``bind()`` does not know
the broker yet, so it cannot pick the engine that holds the broker's database; the caller binds
that engine's connection instead.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import psycopg

from ..errors import ConfigurationError

# Internal: bind() and bind_sessions() use these, applications do not.
__all__: list[str] = []

AnyConnection = psycopg.Connection[Any] | psycopg.AsyncConnection[Any]

_EAGER = "dramatiq_reliable.eager_savepoints"
_SCOPED = ("scoped_session", "async_scoped_session")
_ASYNC = ("AsyncSession", "AsyncConnection", "async_scoped_session")
_FIX_DRIVER = (
    "use psycopg 3: a 'postgresql+psycopg://' URL in create_engine / create_async_engine ('pip install psycopg')"
)


def check_driver(bind: Any, what: str) -> None:
    """Refuse an engine (or connection) whose driver is not psycopg 3, from its dialect: no I/O."""
    dialect = getattr(bind, "dialect", None)
    driver = getattr(dialect, "driver", None)
    if driver is not None and driver != "psycopg":
        raise ConfigurationError(
            f"bind() got a SQLAlchemy {what} on the {driver!r} driver; dramatiq-reliable writes with psycopg 3, "
            f"so its rows could not join that transaction; {_FIX_DRIVER}"
        )


def session_binds(session: Any) -> list[Any]:
    """The distinct engines (or connections) a ``Session`` may use: its ``bind`` and its ``binds``."""
    found: list[Any] = []
    values: Iterable[Any] = [session.bind, *session.binds.values()]
    for value in values:
        if value is not None and not any(value is seen for seen in found):
            found.append(value)
    return found


def _driver(dbapi_connection: Any, what: str) -> AnyConnection:
    conn = getattr(dbapi_connection, "driver_connection", dbapi_connection)
    if isinstance(conn, (psycopg.Connection, psycopg.AsyncConnection)):
        return conn
    raise ConfigurationError(
        f"bind() got a SQLAlchemy {what} on the {type(conn).__module__.split('.')[0]!r} driver; {_FIX_DRIVER}"
    )


def _unscoped(target: Any) -> Any:
    # A scoped_session stands for the session of the current thread (or task): bind that one.
    return target() if type(target).__name__ in _SCOPED else target


def _session_connection(session: Any, what: str) -> Any:
    """``session.connection()`` (which begins the session's transaction), after the checks that need no I/O."""
    from sqlalchemy import exc

    binds = session_binds(session)
    if len(binds) > 1:
        raise ConfigurationError(
            f"bind() got a SQLAlchemy {what} bound to {len(binds)} engines, and cannot tell which holds the "
            "broker's database; bind that engine's connection: bind(session.connection(bind_arguments={'bind': "
            "engine})), or use bind_sessions(), which picks it by the broker's database"
        )
    for bind in binds:
        check_driver(bind, what)
    try:
        connection = session.connection()
    except exc.PendingRollbackError as error:
        raise ConfigurationError(
            f"bind() got a SQLAlchemy {what} whose transaction failed (an earlier flush raised); "
            "call session.rollback() first"
        ) from error
    except exc.UnboundExecutionError as error:
        raise ConfigurationError(
            f"bind() got a SQLAlchemy {what} with no engine; create it with bind=engine"
        ) from error
    eager_savepoints(session)
    return connection


def _savepoint_now(session: Any, transaction: Any) -> None:
    if transaction.nested:
        session.connection()


def eager_savepoints(session: Any) -> None:
    """Make ``session.begin_nested()`` emit its SAVEPOINT at once, on a session bound by ``bind()``.

    A session emits a savepoint lazily, before its own next statement; a send writes on the
    driver connection behind the session's back, so without this a row sent first thing in a
    ``begin_nested()`` block would land before the savepoint and survive its rollback.  Installed
    once per session (its ``info`` remembers it); an unused savepoint costs one round trip.
    """
    from sqlalchemy import event

    if not session.info.get(_EAGER):
        event.listen(session, "after_transaction_create", _savepoint_now)
        session.info[_EAGER] = True


def _connection_dbapi(connection: Any, what: str) -> Any:
    """The pooled DBAPI connection of a SQLAlchemy ``Connection``, refused when it is closed."""
    from sqlalchemy import exc

    check_driver(connection, what)
    try:
        return connection.connection
    except exc.ResourceClosedError as error:
        raise ConfigurationError(
            f"bind() got a closed SQLAlchemy {what}; bind an open one (engine.connect())"
        ) from error
    except exc.PendingRollbackError as error:
        raise ConfigurationError(
            f"bind() got a SQLAlchemy {what} whose transaction failed; roll it back first"
        ) from error


def driver_connection(target: Any) -> AnyConnection:
    """The psycopg connection of a SQLAlchemy ``Session``, ``scoped_session`` or ``Connection``.

    Binding a session begins its transaction (as its first query would); the row then commits
    or rolls back with it.
    """
    from sqlalchemy.engine import Connection
    from sqlalchemy.orm import Session

    target = _unscoped(target)
    name = type(target).__name__
    if name in _ASYNC:
        raise ConfigurationError(f"bind() got a SQLAlchemy {name}; use 'async with bind(session):' in async code")
    if isinstance(target, Session):
        return _driver(_connection_dbapi(_session_connection(target, "Session"), "Session"), "Session")
    if isinstance(target, Connection):
        return _driver(_connection_dbapi(target, "Connection"), "Connection")
    raise ConfigurationError(
        f"bind() needs a SQLAlchemy Session, scoped_session or Connection, got {name!r}; bind the session "
        "or session.connection()"
    )


async def async_driver_connection(target: Any) -> AnyConnection:
    """The psycopg connection of a SQLAlchemy ``AsyncSession``, ``async_scoped_session`` or ``AsyncConnection``
    (or of a sync one)."""
    from sqlalchemy import exc
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

    target = _unscoped(target)
    if isinstance(target, AsyncSession):
        binds = session_binds(target.sync_session)
        if len(binds) > 1:
            raise ConfigurationError(
                f"bind() got a SQLAlchemy AsyncSession bound to {len(binds)} engines, and cannot tell which holds "
                "the broker's database; bind that engine's connection: 'async with bind(await "
                "session.connection(bind_arguments={'bind': engine.sync_engine})):'"
            )
        for bind in binds:
            check_driver(bind, "AsyncSession")
        eager_savepoints(target.sync_session)  # its begin_nested() runs the listener in a greenlet
        try:
            target = await target.connection()
        except exc.PendingRollbackError as error:
            raise ConfigurationError(
                "bind() got a SQLAlchemy AsyncSession whose transaction failed (an earlier flush raised); "
                "call 'await session.rollback()' first"
            ) from error
    if isinstance(target, AsyncConnection):
        check_driver(target.sync_engine, "AsyncConnection")
        if target.closed:
            raise ConfigurationError("bind() got a closed SQLAlchemy AsyncConnection; bind an open one")
        return _driver(await target.get_raw_connection(), "AsyncConnection")
    return driver_connection(target)


def binding_guard(target: Any) -> Callable[[], str | None]:
    """Why a send may no longer join what ``bind(target)`` bound (``None``: it may), with no I/O.

    A session hands its connection back to the pool when its transaction ends (commit,
    rollback, close); the psycopg connection bound at ``bind()`` may then be serving another
    session, so a send later in the same ``with bind(session):`` block must not use it.  Called
    right after :func:`driver_connection` / :func:`async_driver_connection`, so the session's
    transaction is the one the binding joined.
    """
    from sqlalchemy.orm import Session

    target = _unscoped(target)
    session = getattr(target, "sync_session", target)  # an AsyncSession's state lives there
    if isinstance(session, Session):
        transaction = session.get_transaction()
        joined = weakref.ref(transaction) if transaction is not None else None

        def still_joined() -> bool:
            current = session.get_transaction()
            return current is not None and joined is not None and current is joined()

        return lambda: (
            None
            if still_joined()
            else "after the bound SQLAlchemy session's transaction ended (commit, rollback or close): its "
            "connection went back to the pool; send inside the transaction, or bind again for the next one"
        )
    connection = getattr(target, "sync_connection", None) or target  # an AsyncConnection's lives there
    return lambda: (
        "on a bound SQLAlchemy Connection that was closed: its connection went back to the pool; "
        "send before closing it, or bind an open one"
        if connection.closed or connection.invalidated
        else None
    )
