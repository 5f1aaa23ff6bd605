"""The Postgres connection pool a process shares between the broker, the relay and the middleware.

A :class:`Database` opens its pool on first use, not at construction, so building a broker at
import time does no I/O.  Pass your own ``psycopg_pool.ConnectionPool`` to share the app's pool;
the ``Database`` then never closes it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

from .errors import ConfigurationError

__all__ = ["Database"]


class Database:
    """Lazily opened connection pool.

    Parameters:
      url: a libpq connection string or URL (``postgresql://user@host/db``).
      pool: an existing pool to use instead; ``url`` must then be omitted.
      max_size: the pool's maximum size when this object creates it.
      timeout_s: how long to wait for a connection from the pool before failing.
    """

    def __init__(
        self,
        *,
        url: str | None = None,
        pool: ConnectionPool[Any] | None = None,
        max_size: int = 10,
        timeout_s: float = 10.0,
    ) -> None:
        if (url is None) == (pool is None):
            raise ConfigurationError(
                "pass exactly one of database_url= and pool=; for example database_url='postgresql://app@localhost/app'"
            )
        if url is not None and (not isinstance(url, str) or not url.strip()):
            raise ConfigurationError(f"database_url must be a non-empty string, got {type(url).__name__!r}")
        if not isinstance(max_size, int) or max_size < 1:
            raise ConfigurationError(f"max_size must be a positive int, got {max_size!r}")
        if timeout_s <= 0:
            raise ConfigurationError(f"timeout_s must be positive, got {timeout_s!r}")
        self._owned = pool is None
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._opened = not self._owned
        self.pool: ConnectionPool[Any] = pool or ConnectionPool(
            url or "", min_size=1, max_size=max_size, open=False, name="dramatiq-reliable", timeout=timeout_s
        )

    @property
    def conninfo(self) -> str:
        """The connection string of the pool (contains credentials: never log it)."""
        return str(self.pool.conninfo)

    @contextlib.contextmanager
    def connection(self, *, timeout_s: float | None = None) -> Iterator[psycopg.Connection[Any]]:
        """Borrow a connection (waiting at most ``timeout_s``, default the pool's timeout).

        A transaction begun on it must end inside the block.
        """
        if not self._opened:
            with self._lock:
                if not self._opened:
                    self.pool.open(wait=False)
                    self._opened = True
        with self.pool.connection(timeout=timeout_s or self._timeout_s) as conn:
            yield conn

    def connect(self, **kwargs: Any) -> psycopg.Connection[Any]:
        """A new connection outside the pool (for LISTEN, which must hold one connection)."""
        options = self.pool.kwargs if isinstance(self.pool.kwargs, dict) else {}
        return psycopg.connect(self.conninfo, **{**options, **kwargs})

    def close(self) -> None:
        """Close the pool if this object created it."""
        if self._owned and self._opened:
            self.pool.close()
            self._opened = False
