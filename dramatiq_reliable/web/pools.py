"""The web page's connections: a small pool of its own for the dashboard reads, bounded by a statement timeout.

The page reads through the library (``collect_health``, the dead-letter store, the scheduler's
``list_schedules``), which opens its own transactions, so the bound cannot be a ``SET LOCAL``
around them.  Instead the read pool's connections start with ``statement_timeout`` set (libpq's
``options=-c statement_timeout=N``): every statement the page runs to draw a page gives up after
``statement_timeout_ms``, and the page shows that instead of hanging on a locked table.  The pool
is the page's own (at most ``max_size`` connections), so a busy dashboard never takes the app's
connections, and the app's pool keeps its own settings.

Actions (replay, discard, schedule changes) go through the ``database`` given to
:func:`~dramatiq_reliable.web.create_app`, unbounded, as the command line runs them: a replay of a
large group is batched by the store and must not be cut half-way by a dashboard's bound.
"""

from __future__ import annotations

import threading
from typing import Any

import psycopg
from psycopg import conninfo as _conninfo
from psycopg_pool import ConnectionPool

from ..database import Database, DatabaseLike, connection_kwargs

__all__ = []


def action_database(database: DatabaseLike) -> Database:
    """``database`` as a :class:`Database` for the actions (a URL gets a small pool of its own)."""
    if isinstance(database, str):
        return Database(url=database, max_size=2)
    return Database.of(database)


def _unprepared(conn: psycopg.Connection[Any]) -> None:
    """No prepared statements on the page's reads: they work behind a transaction pooler.

    A page runs a handful of statements a minute, so what preparing saves is nothing here, and
    behind PgBouncer in transaction mode a statement prepared on one server process is missing
    on the next (see :meth:`~dramatiq_reliable.database.Database.transaction_pooled`).
    """
    conn.prepare_threshold = None


class ReadPool:
    """A lazily opened pool for the page's reads, each connection bounded by ``statement_timeout_ms``.

    Built from the same connection string (and connection keyword arguments) as ``database``;
    opened on the first read, not at construction, so building the app does no I/O.
    """

    def __init__(self, database: DatabaseLike, *, statement_timeout_ms: int, max_size: int = 4) -> None:
        if isinstance(database, str):
            conninfo, kwargs = database, connection_kwargs(database)
        else:
            shared = Database.of(database)
            pool = shared.pool
            conninfo = shared.conninfo  # a Database may resolve it late (dramatiq_reliable.django)
            kwargs = dict(pool.kwargs) if isinstance(pool.kwargs, dict) else {}
        kwargs["options"] = _with_timeout(conninfo, kwargs.get("options"), statement_timeout_ms)
        self.statement_timeout_ms = statement_timeout_ms
        self._pool: ConnectionPool[Any] = ConnectionPool(
            conninfo,
            kwargs=kwargs,
            min_size=1,
            max_size=max_size,
            open=False,
            name="dramatiq-reliable-web",
            # As long as a connect may take (libpq's connect_timeout default here): a page with
            # Postgres down says so within seconds.
            timeout=5.0,
            configure=_unprepared,
        )
        self._database = Database(pool=self._pool)
        self._lock = threading.Lock()
        self._opened = False

    def get(self) -> Database:
        """The read pool as a :class:`Database`, opened on first use."""
        if not self._opened:
            with self._lock:
                if not self._opened:
                    self._pool.open(wait=False)
                    self._opened = True
        return self._database

    def close(self) -> None:
        """Close the pool's connections, at the app's shutdown."""
        with self._lock:
            if self._opened:
                self._pool.close()
                self._opened = False


def _with_timeout(conninfo: str, given: object, statement_timeout_ms: int) -> str:
    """libpq ``options`` with ``-c statement_timeout=N`` added to what the URL or the pool already set."""
    try:
        from_url = _conninfo.conninfo_to_dict(conninfo).get("options")
    except Exception:  # a malformed URL fails at connect, with the driver's own reason
        from_url = None
    # Pool keyword arguments override the URL's, as libpq reads them: keep whichever applies.
    base = given if isinstance(given, str) else from_url if isinstance(from_url, str) else ""
    return f"{base} -c statement_timeout={int(statement_timeout_ms)}".strip()
