"""The job connection from an async actor, without blocking the event loop the worker shares.

A transactional job's connection is a sync psycopg ``Connection``: ``Idempotency`` opens it,
claims the key on it and commits it from the worker thread.  An async actor (Dramatiq's
``AsyncIO`` middleware) runs on one event loop shared by every async actor of the worker, so a
round trip on that connection made from the coroutine would stall all of them.
:func:`job_connection_async` hands out a facade whose statements run on the job's connection in
a thread (:func:`asyncio.to_thread`): the writes stay in the job's transaction, committed with
its key, and the loop keeps running.

Why not an ``AsyncConnection`` of its own: the key, the actor's writes, its sends and the ack
must be one transaction, and a transaction lives on one connection, the one the middleware
commits from the worker thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import psycopg
from psycopg import sql

from .context import job_connection

__all__ = ["AsyncJobConnection", "job_connection_async"]

Params = Sequence[Any] | Mapping[str, Any] | None
#: What the facade runs: psycopg's query types (``Template`` strings are left to the sync connection).
Query = str | bytes | sql.SQL | sql.Composed


class AsyncJobConnection:
    """The running job's connection, awaitable: each call runs its statement in a thread.

    Rows are returned whole (``fetchone``/``fetchall``), so no cursor crosses back to the loop
    with I/O left to do.  Do not commit or roll back: the job's transaction is the middleware's.
    """

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self._conn = conn

    @property
    def sync(self) -> psycopg.Connection[Any]:
        """The job's connection itself (for code that runs in a thread of its own)."""
        return self._conn

    async def execute(self, query: Query, params: Params = None) -> int:
        """Run one statement; the number of rows it touched (``rowcount``)."""
        return await asyncio.to_thread(lambda: self._conn.execute(query, params).rowcount)

    async def executemany(self, query: Query, params_seq: Iterable[Sequence[Any] | Mapping[str, Any]]) -> None:
        """Run one statement once per parameter set, in one thread hop."""
        rows = list(params_seq)
        await asyncio.to_thread(lambda: self._conn.cursor().executemany(query, rows))

    async def fetchone(self, query: Query, params: Params = None) -> Any:
        """Run a query and return its first row (``None`` when it returned none)."""
        return await asyncio.to_thread(lambda: self._conn.execute(query, params).fetchone())

    async def fetchall(self, query: Query, params: Params = None) -> list[Any]:
        """Run a query and return all its rows."""
        return await asyncio.to_thread(lambda: self._conn.execute(query, params).fetchall())


def job_connection_async() -> AsyncJobConnection:
    """:func:`~dramatiq_reliable.job_connection` for an async actor (transactional mode).

    >>> @dramatiq.actor(idempotency="transactional")              # doctest: +SKIP
    ... async def record(order_id):
    ...     conn = job_connection_async()
    ...     await conn.execute("INSERT INTO invoices (order_id) VALUES (%s)", (order_id,))
    ...     await send_async(notify, order_id)           # joins the same transaction

    Raises :class:`~dramatiq_reliable.NoCurrentJob` outside such a job, as ``job_connection()`` does.
    """
    return AsyncJobConnection(job_connection())
