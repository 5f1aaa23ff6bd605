"""Writes on the worker's behalf that survive a Postgres blip: fresh connections, backoff, a deadline.

After a failover or a cut network a pool still holds connections whose sockets were reset, so a
write that takes the first pooled connection fails although Postgres is back.  :func:`write_within`
runs one transaction, and after a connection-class error retries it on a fresh connection of its
own, with backoff, until a deadline: the caller's ``timeout_ms``, honoured even on a shared pool
whose own wait is longer.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg

from .. import _sql
from .._util import first_line, redact
from ..classify import is_connection_failure
from ..database import Database

__all__ = []

logger = logging.getLogger("dramatiq_reliable.dead_letters")

T = TypeVar("T")

_FIRST_BACKOFF_S = 0.05
_MAX_BACKOFF_S = 1.0


def write_within(database: Database, schema: str, timeout_ms: int, work: Callable[[psycopg.Connection[Any]], T]) -> T:
    """Run ``work(conn)`` in one transaction and return its result, within ``timeout_ms``.

    The first try borrows a pooled connection (waiting for it no longer than the deadline); after a
    connection-class error each retry opens a fresh connection outside the pool, since the pool may
    hand out another stale one.  Other errors (a missing table, a refused value) are raised at once;
    a connection-class error is raised when the deadline leaves no time for another try.
    """
    deadline = time.monotonic() + timeout_ms / 1000
    backoff = _FIRST_BACKOFF_S
    attempt = 0
    while True:
        attempt += 1
        remaining_ms = max(1, int((deadline - time.monotonic()) * 1000))
        try:
            if attempt == 1:
                with database.connection(timeout_ms=remaining_ms) as conn:
                    return _transaction(conn, schema, remaining_ms, work)
            # libpq counts connect_timeout in whole seconds, 2 at least.
            with database.connect(connect_timeout=max(2, math.ceil(remaining_ms / 1000))) as conn:
                return _transaction(conn, schema, remaining_ms, work)
        except psycopg.OperationalError as error:
            if not is_connection_failure(error) or time.monotonic() + backoff >= deadline:
                raise
            logger.warning(
                "dead-letter write failed on attempt %d (%s); retrying on a fresh connection in %d ms",
                attempt,
                redact(first_line(error)),
                backoff * 1000,
            )
            time.sleep(backoff)
            backoff = min(backoff * 2, _MAX_BACKOFF_S)


def _transaction(
    conn: psycopg.Connection[Any], schema: str, timeout_ms: int, work: Callable[[psycopg.Connection[Any]], T]
) -> T:
    with conn.transaction():
        conn.execute(_sql.query("dead_letters_statement_timeout", schema), {"timeout_ms": str(timeout_ms)})
        return work(conn)
