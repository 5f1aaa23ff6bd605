"""Sending from asyncio code: ``await send_async(actor, ...)`` and ``async with broker.transaction()``.

The async send is the sync one with another last step: :meth:`RowSending.enqueue_async
<dramatiq_reliable.sending.RowSending.enqueue_async>` validates, encodes, takes the dedupe key
and runs the enqueue middleware exactly as ``send()`` does, and only the row's statement runs
differently:

* on the bound ``AsyncConnection`` (``async with bind(conn_or_session)`` or ``async with
  broker.transaction()``), awaited, after the same checks as a sync bound connection;
* on a bound *sync* connection (the job connection of an ``Idempotency`` transactional job,
  inside an async actor) in a thread (:func:`asyncio.to_thread`), so the event loop the worker
  shares between its async actors keeps running while the row is written;
* with nothing bound, committed on its own on a connection of the broker's async pool (one per
  event loop, see :class:`~dramatiq_reliable.Database`), with the sync path's retry rules; or
  ``NotBound`` under ``on_unbound="error"``.  Inside an async actor it is a worker's send (never
  refused, retried for ``worker_write_timeout_ms``) on the worker's sync pool in a thread, so
  Dramatiq's event loop, which is stopped without its tasks being cancelled, holds no async pool.

Why functions and not ``actor.send_async()``: Dramatiq's ``Actor`` class is not ours, and
patching a method onto it would change every actor of every broker in the process.  A
function taking the actor works with any actor, is typed, and on a broker that is not ours
(``StubBroker`` in tests) it falls back to that broker's ``enqueue``.

Async actors (Dramatiq's ``AsyncIO`` middleware) need nothing more: Dramatiq hands the
coroutine to its event loop thread with ``run_coroutine_threadsafe``, whose
``call_soon_threadsafe`` copies the *calling* worker thread's context, so the coroutine's task
sees the job of ``Idempotency``, the bound job connection and the message being processed
(tests/integration/test_send_async.py runs such an actor on both brokers).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any

import dramatiq
import psycopg
from dramatiq.message import Message

from .binding import bind, bound_transaction
from .errors import ConfigurationError

if TYPE_CHECKING:
    from .database import Database

__all__ = ["BrokerTransaction", "send_async", "send_async_with_options"]


class BrokerTransaction:
    """What ``broker.transaction()`` returns: a transaction on a pooled connection, bound for sends.

    ``with`` it in sync code (a connection of the broker's pool; ``actor.send()`` joins it) or
    ``async with`` it in async code (a connection of the broker's async pool; ``await
    send_async(...)`` joins it).  One method for both, as :func:`~dramatiq_reliable.bind` is:
    the choice is made by the ``with`` the caller writes, not by a second name to remember.
    Either way the transaction commits when the block exits normally and rolls back when it raises.
    """

    def __init__(self, database: Database) -> None:
        self._database = database
        self._sync: list[contextlib.AbstractContextManager[psycopg.Connection[Any]]] = []
        self._async: list[contextlib.AsyncExitStack] = []

    def __enter__(self) -> psycopg.Connection[Any]:
        block = bound_transaction(self._database)
        conn = block.__enter__()
        self._sync.append(block)
        return conn

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        return self._sync.pop().__exit__(kind, error, tb)

    async def __aenter__(self) -> psycopg.AsyncConnection[Any]:
        async with contextlib.AsyncExitStack() as stack:
            conn = await stack.enter_async_context(self._database.async_connection())
            await stack.enter_async_context(conn.transaction())
            await stack.enter_async_context(bind(conn))
            self._async.append(stack.pop_all())
        return conn

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        return await self._async.pop().__aexit__(kind, error, tb)


def _check_actor(actor: object, caller: str) -> dramatiq.Actor[Any, Any]:
    if not isinstance(actor, dramatiq.Actor):
        raise ConfigurationError(
            f"{caller}() needs a Dramatiq actor as its first argument, got {type(actor).__name__!r}; "
            f"pass the decorated function itself: await {caller}(my_actor, ...)"
        )
    return actor


async def send_async(actor: dramatiq.Actor[Any, Any], *args: Any, **kwargs: Any) -> Message[Any]:
    """``actor.send(*args, **kwargs)`` for async code: the row joins the bound async transaction.

    >>> async with broker.transaction() as conn:                  # doctest: +SKIP
    ...     await conn.execute("INSERT INTO orders (id) VALUES (%s)", (42,))
    ...     await send_async(send_receipt, 42)
    """
    return await send_async_with_options(_check_actor(actor, "send_async"), args=args, kwargs=kwargs)


async def send_async_with_options(
    actor: dramatiq.Actor[Any, Any],
    *,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    delay: int | None = None,
    **options: Any,
) -> Message[Any]:
    """``actor.send_with_options(...)`` for async code (``delay`` in milliseconds, message options
    such as ``dedupe_key`` or ``idempotency_key``); returns the message sent, or the first one's
    id when its dedupe key was held."""
    _check_actor(actor, "send_async_with_options")
    if not isinstance(args, tuple) or not (kwargs is None or isinstance(kwargs, dict)):
        raise ConfigurationError(
            f"send_async_with_options() of actor {actor.actor_name!r} needs args= as a tuple and kwargs= as a "
            f"dict, got {type(args).__name__!r} and {type(kwargs).__name__!r}; e.g. args=(order_id,)"
        )
    message = actor.message_with_options(args=args, kwargs=kwargs or {}, **options)
    enqueue_async: Callable[..., Awaitable[Message[Any]]] | None = getattr(actor.broker, "enqueue_async", None)
    if enqueue_async is None:
        # Not a Postgres-backed broker (StubBroker in tests): no transaction to join, its
        # enqueue does no database I/O of ours.
        return actor.broker.enqueue(message, delay=delay)
    return await enqueue_async(message, delay=delay)
