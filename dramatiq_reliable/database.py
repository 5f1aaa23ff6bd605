"""The Postgres connection pool a process shares between the broker, the relay and the middleware.

A :class:`Database` opens its pool on first use, not at construction, so building a broker at
import time does no I/O.  Async sends (``await send_async(...)``, ``async with
broker.transaction()``) use a second, async pool on the same conninfo, also opened on first use:
one per event loop, since an ``AsyncConnectionPool`` belongs to the loop that opened it (a
FastAPI app's loop and Dramatiq's ``AsyncIO`` worker loop each get theirs).  Every constructor of this package that needs Postgres takes one
``database=`` argument: a URL, an existing ``psycopg_pool.ConnectionPool`` (the app's own, which
is then never closed by us), or a :class:`Database` to share between several parts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import weakref
from collections.abc import AsyncIterator, Iterator
from typing import Any, Union

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from . import _sql
from ._checks import check_int, check_ms
from .errors import ConfigurationError

__all__ = ["Database", "DatabaseLike"]

logger = logging.getLogger("dramatiq_reliable.database")

#: What a ``database=`` argument accepts.
DatabaseLike = Union[str, "ConnectionPool[Any]", "Database"]


#: libpq settings that bound every wait on a connection we open, unless the URL sets them:
#: a connect gives up after 5 s, and a silent partition (no RST) is noticed within about 11 s,
#: by TCP keepalives on an idle socket and tcp_user_timeout on unacknowledged data, instead of
#: the kernel's many minutes.  Statement timeouts are not set here: the pool also serves the
#: app's own transactions (broker.transaction(), jobs), which we never bound.
CONNECTION_DEFAULTS: dict[str, Any] = {
    "connect_timeout": 5,
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 3,
    "tcp_user_timeout": 10_000,
}


def connection_kwargs(url: str) -> dict[str, Any]:
    """:data:`CONNECTION_DEFAULTS` less what the URL (or a ``PG*`` variable) sets itself, for
    any pool or connection opened on ``url`` (the web page's read pool uses it too)."""
    import os

    try:
        given = set(psycopg.conninfo.conninfo_to_dict(url))
    except psycopg.ProgrammingError:
        given = set()  # a malformed URL fails at connect, with the driver's (redacted) reason
    if "PGCONNECT_TIMEOUT" in os.environ:
        given.add("connect_timeout")
    return {key: value for key, value in CONNECTION_DEFAULTS.items() if key not in given}


class Database:
    """Lazily opened connection pool.

    Parameters:
      url: a libpq connection string or URL (``postgresql://user@host/db``).
      pool: an existing pool to use instead; ``url`` must then be omitted.
      max_size: the pool's maximum size when this object creates it.
      timeout_ms: how long to wait for a connection from the pool before failing.
    """

    def __init__(
        self,
        *,
        url: str | None = None,
        pool: ConnectionPool[Any] | None = None,
        max_size: int = 10,
        timeout_ms: int = 10_000,
    ) -> None:
        if (url is None) == (pool is None):
            raise ConfigurationError(
                "pass exactly one of url= and pool= to Database; for example Database(url='postgresql://app@localhost/app')"
            )
        if url is not None and (not isinstance(url, str) or not url.strip()):
            raise ConfigurationError(f"url must be a non-empty string, got {type(url).__name__!r}")
        check_int("max_size", max_size, minimum=1, fix="e.g. max_size=10")
        check_ms("timeout_ms", timeout_ms, minimum=1, fix="e.g. timeout_ms=10000")
        self._owned = pool is None
        self._timeout_s = timeout_ms / 1000
        self._lock = threading.Lock()
        self._opened = not self._owned
        self._identity: tuple[str | None, int | None] | None = None
        self._pooled: bool | None = None  # behind a transaction pooler: transaction_pooled()
        # per event loop: its pool, and every connection that pool opened, so close() can end
        # those of a loop already closed (whose pool can no longer run its own close)
        self._async_pools: dict[asyncio.AbstractEventLoop, _AsyncPool] = {}
        self.pool: ConnectionPool[Any] = pool or ConnectionPool(
            url or "",
            kwargs=connection_kwargs(url or ""),
            min_size=1,
            max_size=max_size,
            open=False,
            name="dramatiq-reliable",
            timeout=self._timeout_s,
            configure=self._configure,
        )

    def _configure(self, conn: psycopg.Connection[Any]) -> None:
        """Each new pooled connection: no prepared statements behind a transaction pooler.

        psycopg prepares a statement after a few runs, on the server process of that moment;
        behind PgBouncer in transaction mode (before 1.21) the next transaction may run on
        another process, where the statement does not exist.  Prepared statements halve a
        short statement's server time on a local socket, so they are dropped only there:
        detected once per Database (:func:`~dramatiq_reliable.pooler.behind_transaction_pooler`).
        """
        if self.transaction_pooled():
            conn.prepare_threshold = None

    def transaction_pooled(self) -> bool:
        """Whether this pool's connections go through a pooler in transaction mode (detected once).

        Two connections: while the second holds a transaction (and so its server process), the
        first's next statement must run on another process if the pooler hands processes out
        per transaction; Postgres itself, or a session pooler, keeps one process per connection.
        Three rounds, since the pooler may give the first connection the same idle process twice.
        """
        if self._pooled is None:
            found = False
            with self.connect(autocommit=True) as first, self.connect(autocommit=True) as second:
                for _ in range(3):
                    before = _backend(first)
                    with second.transaction():
                        held = _backend(second)
                        after = _backend(first)
                    if before != after or before == held:
                        found = True
                        break
            self._pooled = found
        return self._pooled

    @classmethod
    def of(cls, value: object, *, argument: str = "database", max_size: int = 10, timeout_ms: int = 10_000) -> Database:
        """``value`` as a :class:`Database`: a URL or a pool is wrapped, a ``Database`` is shared as it is."""
        if isinstance(value, Database):
            return value
        if isinstance(value, ConnectionPool):
            return cls(pool=value, max_size=max_size, timeout_ms=timeout_ms)
        if isinstance(value, str):
            return cls(url=value, max_size=max_size, timeout_ms=timeout_ms)
        raise ConfigurationError(
            f"{argument}= must be a Postgres URL, a psycopg_pool.ConnectionPool or a dramatiq_reliable.Database, "
            f"got {type(value).__name__!r}; for example {argument}='postgresql://app@localhost/app'"
        )

    @property
    def owned(self) -> bool:
        """Whether this object created its pool (and so closes it)."""
        return self._owned

    @property
    def conninfo(self) -> str:
        """The connection string of the pool (contains credentials: never log it)."""
        return str(self.pool.conninfo)

    def identity(self) -> tuple[str | None, int | None]:
        """The database name and port this pool connects to, as far as its conninfo says (no I/O).

        ``None`` where the conninfo leaves it to libpq's defaults: a bound connection is then not
        checked on that point rather than refused on a guess.
        """
        if self._identity is None:
            try:
                given = psycopg.conninfo.conninfo_to_dict(self.conninfo)
            except psycopg.ProgrammingError:
                given = {}
            port = str(given.get("port") or "").split(",")[0]
            dbname = given.get("dbname")
            self._identity = (str(dbname) if dbname else None, int(port) if port.isdigit() else None)
        return self._identity

    @contextlib.contextmanager
    def connection(self, *, timeout_ms: int | None = None) -> Iterator[psycopg.Connection[Any]]:
        """Borrow a connection (waiting at most ``timeout_ms``, default the pool's timeout).

        A transaction begun on it must end inside the block.
        """
        self.open()
        with self.pool.connection(timeout=timeout_ms / 1000 if timeout_ms else self._timeout_s) as conn:
            yield conn

    @contextlib.contextmanager
    def autocommit(self, *, timeout_ms: int | None = None) -> Iterator[psycopg.Connection[Any]]:
        """Borrow a connection in autocommit (one round trip a statement), given back as it came.

        The pool may be the application's, whose connections may not be in autocommit: one that
        is not is rolled back first and put back in its own mode.
        """
        with self.connection(timeout_ms=timeout_ms) as conn:
            previous = conn.autocommit
            if not previous:
                conn.rollback()
                conn.autocommit = True
            try:
                yield conn
            finally:
                if not previous and not conn.closed and not conn.broken:
                    conn.autocommit = False

    def open(self) -> None:
        """Open the pool now if this object created it (without waiting for a connection)."""
        if not self._opened:
            with self._lock:
                if not self._opened:
                    self.pool.open(wait=False)
                    self._opened = True

    def connect(self, **kwargs: Any) -> psycopg.Connection[Any]:
        """A new connection outside the pool (for LISTEN, which must hold one connection)."""
        options = self.pool.kwargs if isinstance(self.pool.kwargs, dict) else {}
        return psycopg.connect(self.conninfo, **{**options, **kwargs})

    def close(self) -> None:
        """Close the pool if this object created it, and the async pools (see :meth:`aclose`)."""
        self._close_async_pools()
        if self._owned and self._opened:
            self.pool.close()
            self._opened = False

    # -- the async pools ---------------------------------------------------------------------------

    async def async_pool(self) -> AsyncConnectionPool[Any]:
        """The async pool of the running event loop, created and opened on first use.

        Always ours (also when the sync pool is the application's): built from the same
        conninfo, with :data:`CONNECTION_DEFAULTS` and the sync pool's maximum size.
        """
        loop = asyncio.get_running_loop()
        with self._lock:
            entry = self._async_pools.get(loop)
            if entry is None or entry.spent:
                # Pools of loops gone, and this loop's if its guard closed it (every task of
                # the loop was cancelled, and the loop went on): a closed pool cannot reopen.
                for stale in [other for other, old in self._async_pools.items() if other.is_closed() or old.spent]:
                    _end_connections(self._async_pools.pop(stale).opened)
                opened: weakref.WeakSet[psycopg.AsyncConnection[Any]] = weakref.WeakSet()

                async def track(conn: psycopg.AsyncConnection[Any]) -> None:
                    opened.add(conn)
                    if await asyncio.to_thread(self.transaction_pooled):
                        conn.prepare_threshold = None  # as in _configure

                options = self.pool.kwargs if isinstance(self.pool.kwargs, dict) else {}
                entry = self._async_pools[loop] = _AsyncPool(
                    AsyncConnectionPool(
                        self.conninfo,
                        kwargs={**connection_kwargs(self.conninfo), **options},
                        # no connection opened in the background: a loop that ends without
                        # aclose() then has no connect of ours in flight to cancel
                        min_size=0,
                        max_size=self.pool.max_size,
                        open=False,
                        name="dramatiq-reliable-async",
                        timeout=self._timeout_s,
                        configure=track,
                    ),
                    opened,
                )
        pool = entry.pool
        if pool.closed:
            await pool.open(wait=False)
            entry.guard_loop_end()
        return pool

    @contextlib.asynccontextmanager
    async def async_connection(self, *, timeout_ms: int | None = None) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """Borrow a connection of the running loop's async pool (waiting at most ``timeout_ms``)."""
        pool = await self.async_pool()
        async with pool.connection(timeout=timeout_ms / 1000 if timeout_ms else self._timeout_s) as conn:
            yield conn

    @contextlib.asynccontextmanager
    async def async_autocommit(self, *, timeout_ms: int | None = None) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """Borrow an async connection in autocommit: one round trip a statement."""
        async with self.async_connection(timeout_ms=timeout_ms) as conn:
            if not conn.autocommit:
                await conn.set_autocommit(True)
            yield conn

    async def aclose(self) -> None:
        """Close the running loop's async pool (await it before that loop ends: a FastAPI
        lifespan's shutdown), then everything :meth:`close` closes."""
        loop = asyncio.get_running_loop()
        with self._lock:
            entry = self._async_pools.pop(loop, None)
        if entry is not None:
            await entry.pool.close()
            entry.stand_down()
        await asyncio.to_thread(self.close)

    def _close_async_pools(self) -> None:
        """Close the async pools from sync code, each the way its loop allows.

        A loop running in another thread closes its pool there; a loop not running closes it
        here; on a loop already closed (one that ended without aclose()) the pool's tasks are
        gone, so its connections are ended one by one.  Called from the loop's own thread (a
        sync ``close()`` inside async code), the close is scheduled on that loop.
        """
        with self._lock:
            pools = list(self._async_pools.items())
            self._async_pools.clear()
        try:
            current: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            current = None
        for loop, entry in pools:
            pool, opened = entry.pool, entry.opened
            if loop.is_closed() or pool.closed:
                _end_connections(opened)
            elif loop is current:
                loop.create_task(pool.close())
            elif loop.is_running():
                try:
                    asyncio.run_coroutine_threadsafe(pool.close(), loop).result(timeout=self._timeout_s)
                except Exception as error:  # the loop stopped meanwhile: end what is left
                    logger.warning("could not close an async pool on its loop (%s); ending its connections", error)
                    _end_connections(opened)
            else:
                loop.run_until_complete(pool.close())


def _backend(conn: psycopg.Connection[Any]) -> int:
    """The server process running ``conn``'s statement (a pooler in transaction mode changes it)."""
    row = conn.cursor(row_factory=dict_row).execute(_sql.query("doctor_backend", _sql.DEFAULT_SCHEMA)).fetchone()
    assert row is not None
    return int(row["backend_pid"])


#: How long an async pool's own tasks get to stop when its loop ends without ``aclose()``.
_CLOSE_AT_LOOP_END_S = 5.0


class _AsyncPool:
    """One event loop's async pool, the connections it opened, and its guard against a hung loop end.

    ``asyncio.run()`` ends by cancelling every task left and waiting for them all, the pool's
    own tasks included.  On Python 3.11, ``asyncio.wait_for`` can swallow a cancellation when
    what it waits for completes at that moment (CPython gh-86296, fixed in 3.12 only), and
    psycopg_pool's scheduler waits in ``wait_for`` in a loop: a swallowed cancellation keeps it
    waiting, and the program's exit with it, for up to ten minutes.  The guard is a task of ours
    on the same loop; cancelled with the rest, it closes the pool, whose close tells the
    scheduler to stop whatever cancellation it missed.  ``aclose()`` stands it down first.
    """

    def __init__(self, pool: AsyncConnectionPool[Any], opened: weakref.WeakSet[psycopg.AsyncConnection[Any]]) -> None:
        self.pool = pool
        self.opened = opened
        self._guard: asyncio.Task[None] | None = None

    @property
    def spent(self) -> bool:
        """Opened once and closed since: it cannot serve again."""
        return self._guard is not None and self.pool.closed

    def guard_loop_end(self) -> None:
        """Start the guard on the running loop (the pool's), once the pool is open."""
        if self._guard is None:
            self._guard = asyncio.get_running_loop().create_task(
                self._close_at_loop_end(), name="dramatiq-reliable-async-pool-guard"
            )

    def stand_down(self) -> None:
        """The pool was closed on purpose (``aclose()``): the guard ends without doing anything."""
        if self._guard is not None:
            self._guard.cancel()

    async def _close_at_loop_end(self) -> None:
        try:
            await asyncio.get_running_loop().create_future()  # done only by a cancel
        except asyncio.CancelledError:
            if self.pool.closed:
                return
            # The close schedules the scheduler's stop before it waits for the workers (which
            # the loop's end has cancelled already: the wait may raise), then the sockets go.
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await self.pool.close(timeout=_CLOSE_AT_LOOP_END_S)
            _end_connections(self.opened)


def _end_connections(opened: weakref.WeakSet[psycopg.AsyncConnection[Any]]) -> None:
    """End the sockets of a pool whose loop is closed: no task of it can use them any more."""
    for conn in list(opened):
        if not conn.closed:
            conn.pgconn.finish()
