"""SQLAlchemy sessions and connections as the transaction ``send()`` joins.

``bind(session)`` (sync) and ``async with bind(async_session)`` reach the psycopg 3 connection
under SQLAlchemy's pool: the outbox row is then one more statement of the session's
transaction, committed or rolled back with it.  Only the psycopg driver
(``postgresql+psycopg://``) qualifies; a session on psycopg2 or asyncpg is refused with the fix,
since its connection cannot run our statements.

SQLAlchemy is imported only when such an object is bound (it is an optional extra).
"""

from __future__ import annotations

from typing import Any

import psycopg

from .errors import ConfigurationError

# Internal: the names below are used by bind(), not by applications.
__all__: list[str] = []

_ASYNC = ("AsyncSession", "AsyncConnection", "async_scoped_session")


def _driver(dbapi_connection: Any, what: str) -> psycopg.Connection[Any] | psycopg.AsyncConnection[Any]:
    conn = getattr(dbapi_connection, "driver_connection", dbapi_connection)
    if isinstance(conn, (psycopg.Connection, psycopg.AsyncConnection)):
        return conn
    raise ConfigurationError(
        f"bind() got a SQLAlchemy {what} on the {type(conn).__module__.split('.')[0]!r} driver; "
        "use psycopg 3: a 'postgresql+psycopg://' URL (create_engine / create_async_engine)"
    )


def driver_connection(target: Any) -> psycopg.Connection[Any] | psycopg.AsyncConnection[Any]:
    """The psycopg connection of a SQLAlchemy ``Session`` or ``Connection`` (the session's transaction begins)."""
    from sqlalchemy.engine import Connection
    from sqlalchemy.orm import Session

    name = type(target).__name__
    if name in _ASYNC:
        raise ConfigurationError(f"bind() got a SQLAlchemy {name}; use 'async with bind(session):' in async code")
    if isinstance(target, Session):
        return _driver(target.connection().connection, "Session")
    if isinstance(target, Connection):
        return _driver(target.connection, "Connection")
    raise ConfigurationError(
        f"bind() needs a SQLAlchemy Session or Connection, got {name!r}; bind session or session.connection()"
    )


async def async_driver_connection(target: Any) -> psycopg.Connection[Any] | psycopg.AsyncConnection[Any]:
    """The psycopg connection of a SQLAlchemy ``AsyncSession`` or ``AsyncConnection`` (or a sync one)."""
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

    if isinstance(target, AsyncSession):
        target = await target.connection()
    if isinstance(target, AsyncConnection):
        raw = await target.get_raw_connection()
        return _driver(raw, "AsyncConnection")
    return driver_connection(target)
