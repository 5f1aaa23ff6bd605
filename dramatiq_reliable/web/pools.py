"""The web page's connections: a small pool of its own for the dashboard reads, bounded by a statement timeout.

The page reads through the library (``collect_health``, the dead-letter store, the scheduler's
``list_schedules``), which opens its own transactions, so the bound cannot be a ``SET LOCAL``
around them.  Instead the read pool's connections start with ``statement_timeout`` set (libpq's
``options=-c statement_timeout=N``): every statement the page runs to draw a page gives up after
``statement_timeout_ms``, and the page shows that instead of hanging on a locked table.  Behind
a transaction pooler that cannot work: PgBouncer refuses the ``options`` startup parameter
("unsupported startup parameter: options") or, told to ignore it, drops it, and a setting of the
connection would stay on a server process that other clients get next.  There (detected on the
first read) each borrow is one transaction whose first statement is ``SET LOCAL
statement_timeout``, and what the library runs inside it nests as savepoints.  The pool
is the page's own (at most ``max_size`` connections), so a busy dashboard never takes the app's
connections, and the app's pool keeps its own settings.

Actions (replay, discard, schedule changes) go through the ``database`` given to
:func:`~dramatiq_reliable.web.create_app`, unbounded, as the command line runs them: a replay of a
large group is batched by the store and must not be cut half-way by a dashboard's bound.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg import conninfo as _conninfo
from psycopg import sql
from psycopg_pool import ConnectionPool

from .. import _sql
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
        options = _with_timeout(conninfo, kwargs.get("options"), statement_timeout_ms)
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
        self._database = _Reads(self._pool, options=options, statement_timeout_ms=statement_timeout_ms)

    def get(self) -> Database:
        """The read pool as a :class:`Database`; it opens on its first read."""
        return self._database

    def close(self) -> None:
        """Close the pool's connections, at the app's shutdown."""
        self._database.stop()


class _Reads(Database):
    """The read pool as a :class:`Database`, bounded per connection directly and per borrow behind
    a transaction pooler (see the module docstring); started on the first borrow."""

    def __init__(self, pool: ConnectionPool[Any], *, options: str, statement_timeout_ms: int) -> None:
        super().__init__(pool=pool)
        self._options = options
        self._timeout_ms = statement_timeout_ms
        self._start_lock = threading.Lock()
        self._started = False

    def _start(self) -> bool:
        """Open the pool once; whether each borrow must set the bound itself (behind a transaction pooler)."""
        if not self._started:
            with self._start_lock:
                if not self._started:
                    # Detected before ``options`` is added: a pooler that refuses it would refuse the probe too.
                    if not self.transaction_pooled():
                        assert isinstance(self.pool.kwargs, dict)
                        self.pool.kwargs["options"] = self._options
                    self.pool.open(wait=False)
                    self._started = True
        return self.transaction_pooled()

    def connect(self, **kwargs: Any) -> psycopg.Connection[Any]:
        """A connection outside the pool (the pooler probe), as bounded in time as the pool's borrows."""
        return super().connect(**{"connect_timeout": 5, **kwargs})

    @contextlib.contextmanager
    def connection(self, *, timeout_ms: int | None = None) -> Iterator[psycopg.Connection[Any]]:
        per_borrow = self._start()
        with super().connection(timeout_ms=timeout_ms) as conn:
            if not per_borrow:
                yield conn
                return
            conn.autocommit = False
            conn.execute(sql.SQL(_sql.read("web_read_timeout")).format(timeout_ms=sql.Literal(self._timeout_ms)))
            try:
                yield conn
            except BaseException:
                if not conn.closed:
                    conn.rollback()
                raise
            if not conn.closed:
                conn.commit()

    @contextlib.contextmanager
    def autocommit(self, *, timeout_ms: int | None = None) -> Iterator[psycopg.Connection[Any]]:
        """Directly, as :meth:`Database.autocommit`; behind a transaction pooler the borrow's one
        bounded transaction instead (the page only reads, so nothing waits on its commit)."""
        if not self._start():
            with super().autocommit(timeout_ms=timeout_ms) as conn:
                yield conn
            return
        with self.connection(timeout_ms=timeout_ms) as conn:
            yield conn

    def stop(self) -> None:
        with self._start_lock:
            if self._started:
                self.pool.close()
                self._started = False


def _with_timeout(conninfo: str, given: object, statement_timeout_ms: int) -> str:
    """libpq ``options`` with ``-c statement_timeout=N`` added to what the URL or the pool already set."""
    try:
        from_url = _conninfo.conninfo_to_dict(conninfo).get("options")
    except Exception:  # a malformed URL fails at connect, with the driver's own reason
        from_url = None
    # Pool keyword arguments override the URL's, as libpq reads them: keep whichever applies.
    base = given if isinstance(given, str) else from_url if isinstance(from_url, str) else ""
    return f"{base} -c statement_timeout={int(statement_timeout_ms)}".strip()
