"""Dedupe at enqueue: a second send with the same key inside a window is ignored and returns the first message.

A send with a dedupe key (``send_with_options(dedupe_key="order-42")``, or the actor option
``dedupe_key=lambda order_id: f"order-{order_id}"``) takes the key in the ``send_dedupe`` table in
the same transaction as the message's own row, through the one send path
(:class:`~dramatiq_reliable.sending.RowSending`, so on ``OutboxBroker`` and ``PostgresBroker``):

* **Scope.**  Keys are per actor: ``("send_invoice", "order-42")`` and ``("ship", "order-42")``
  are two keys, as are the processed-job keys of :class:`~dramatiq_reliable.Idempotency`.
* **Inside the window** (``dedupe_window_ms``, counted from the first send's transaction) a
  second send writes nothing and returns the first message's id.
* **Rollback.**  The key is written with the message: a rolled-back send keeps neither, and a
  concurrent second sender, which waits on the unique key, then takes it and sends.
* **After the window** the next send takes the key over and writes a new message.
* **Delayed messages** hold the key from the send, not from their eta: give a window longer
  than the delay to dedupe until the message has run.
* **Retries** of a message (a worker re-sending the message it processes) are never deduped.

The processed-job key still guards the consume side: dedupe at enqueue saves the duplicate
write, publish and delivery; ``Idempotency`` is what makes a redelivered message run once.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping
from typing import Any

import dramatiq
import psycopg
from dramatiq.broker import Broker
from dramatiq.errors import ActorNotFound
from dramatiq.message import Message
from dramatiq.middleware import Middleware
from psycopg import sql
from psycopg.rows import dict_row

from . import _sql
from ._checks import MAX_MS, check_int, check_ms, is_int
from .database import Database, DatabaseLike
from .errors import ActorOptionError, PayloadError
from .schema import table_exists

__all__ = ["DEFAULT_DEDUPE_WINDOW_MS", "MAX_DEDUPE_KEY_BYTES", "DedupeOptions", "purge_dedupe_keys"]

#: How long a key dedupes when no window is given: SQS FIFO's five minutes, long enough for a
#: double click, a retried HTTP request or a redelivered webhook, short enough to keep the table small.
DEFAULT_DEDUPE_WINDOW_MS = 5 * 60 * 1000

#: Keys past this many UTF-8 bytes are refused at ``send()``: they must fit a btree index entry.
MAX_DEDUPE_KEY_BYTES = 1000

logger = logging.getLogger("dramatiq_reliable.dedupe")

_OPTIONS = frozenset({"dedupe_key", "dedupe_window_ms"})
_KEY_FIX = "pass a non-empty string of readable characters, e.g. send_with_options(dedupe_key='order-42')"
_WINDOW_FIX = "a window in milliseconds, e.g. dedupe_window_ms=300_000 for five minutes"


class DedupeOptions(Middleware):
    """Declares the actor options ``dedupe_key`` (a callable) and ``dedupe_window_ms``, and checks them.

    Every Postgres-backed broker adds it itself; the dedupe is done by the send path, so there
    is nothing to configure.
    """

    @property
    def actor_options(self) -> set[str]:
        return set(_OPTIONS)

    def before_declare_actor(self, broker: Broker, actor: dramatiq.Actor[Any, Any]) -> None:
        key = actor.options.get("dedupe_key")
        if key is not None and not callable(key):
            raise ActorOptionError(
                f"actor {actor.actor_name!r}: dedupe_key must be a callable taking the actor's arguments, got "
                f"{key!r}; write e.g. dedupe_key=lambda order_id: f'order-{{order_id}}' (a fixed string belongs in "
                "send_with_options(dedupe_key=...))"
            )
        if "dedupe_window_ms" in actor.options:
            check_ms(
                f"actor {actor.actor_name!r}: dedupe_window_ms",
                actor.options["dedupe_window_ms"],
                minimum=1,
                fix=_WINDOW_FIX,
                error=ActorOptionError,
            )

    @staticmethod
    def install(broker: Broker) -> None:
        """Add the options at the front of ``broker``'s middleware unless they are there.

        At the front, not the end: middleware whose place matters (the retries last) keep it.
        """
        if any(isinstance(m, DedupeOptions) for m in broker.middleware):
            return
        if broker.middleware:
            broker.add_middleware(DedupeOptions(), before=type(broker.middleware[0]))
        else:
            broker.add_middleware(DedupeOptions())


def _where(message: Message[Any]) -> str:
    return f"message {message.message_id!r} for actor {message.actor_name!r}"


def dedupe_of(broker: Broker, message: Message[Any]) -> tuple[str, int] | None:
    """The dedupe key and window of ``message``, or ``None``; ``PayloadError`` before any SQL when bad.

    The message option wins over the actor option; an actor this broker does not know (a
    producer that builds messages by hand) has no actor options.
    """
    try:
        actor_options: dict[str, Any] = broker.get_actor(message.actor_name).options
    except ActorNotFound:
        actor_options = {}
    key: object = message.options.get("dedupe_key")
    source = "dedupe_key"
    if key is None and (derive := actor_options.get("dedupe_key")) is not None:
        source = f"the dedupe_key function {getattr(derive, '__qualname__', derive)!r}"
        try:
            key = derive(*message.args, **message.kwargs)
        except Exception as error:
            raise PayloadError(
                f"{_where(message)}: {source} raised {type(error).__name__}: {error}; fix the key function or the "
                "arguments (nothing was sent)"
            ) from error
        if key is None:  # the function may opt a call out of dedupe
            return None
    if key is None:
        if "dedupe_window_ms" in message.options:
            raise PayloadError(f"{_where(message)} has dedupe_window_ms but no dedupe_key; {_KEY_FIX}")
        return None
    if not isinstance(key, str) or not key.strip():
        raise PayloadError(f"{_where(message)}: {source} gave {key!r}, not a non-empty string; {_KEY_FIX}")
    if "\x00" in key:
        raise PayloadError(
            f"{_where(message)}: {source} holds a NUL character, which Postgres cannot store; {_KEY_FIX}"
        )
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError as error:
        raise PayloadError(f"{_where(message)}: {source} is not valid Unicode ({error.reason}); {_KEY_FIX}") from None
    if size > MAX_DEDUPE_KEY_BYTES:
        raise PayloadError(
            f"{_where(message)}: {source} is {size} bytes, over {MAX_DEDUPE_KEY_BYTES}; build keys from IDs, "
            "or hash long values"
        )
    window = message.options.get("dedupe_window_ms", actor_options.get("dedupe_window_ms", DEFAULT_DEDUPE_WINDOW_MS))
    if not is_int(window) or not 1 <= window <= MAX_MS:
        raise PayloadError(f"{_where(message)} has dedupe_window_ms={window!r}; give {_WINDOW_FIX}")
    return key, window


def insert_row(
    conn: psycopg.Connection[Any], statement: bytes | sql.Composed, row: Mapping[str, Any], key: str, window_ms: int
) -> str:
    """Run a broker's ``*_insert_dedupe.sql``: take ``key`` and write ``row`` in one round trip.

    Returns the id of the message that holds the key: ``row``'s own when the key was free,
    expired, or already this message's (a send tried again after a failed commit), and the row
    was written; another id means a duplicate, and nothing was written.
    """
    found = (
        conn.cursor(row_factory=dict_row)
        .execute(statement, {**row, "dedupe_key": key, "window_ms": window_ms})
        .fetchone()
    )
    assert found is not None  # INSERT ... ON CONFLICT DO UPDATE returns its row
    return str(found["message_id"])


def purge_dedupe_keys(database: DatabaseLike, *, schema: str = _sql.DEFAULT_SCHEMA, batch_size: int = 5000) -> int:
    """Delete expired dedupe keys in batches of ``batch_size``; return how many were deleted.

    Each batch is its own short transaction.  ``PostgresBroker``'s housekeeping and the outbox
    relay call it with their other purges; a schema not migrated to dedupe yet has nothing to purge.
    """
    schema_name = _sql.validate_schema(schema)
    check_int("batch_size", batch_size, minimum=1, fix="e.g. batch_size=5000")
    owned = not isinstance(database, Database)
    database = Database.of(database)
    with contextlib.ExitStack() as stack:
        if owned:
            stack.callback(database.close)
        conn = stack.enter_context(database.autocommit())
        return purge_on(conn, schema_name, batch_size=batch_size)


def purge_on(conn: psycopg.Connection[Any], schema: str, *, batch_size: int = 5000) -> int:
    """:func:`purge_dedupe_keys` on an autocommit connection the caller holds."""
    if not table_exists(conn, schema, "send_dedupe"):
        return 0
    started = time.perf_counter()
    total = 0
    while True:
        deleted = conn.execute(_sql.query("dedupe_purge", schema), {"batch_size": batch_size}).rowcount
        total += deleted
        if deleted < batch_size:
            break
    if total:
        logger.debug(
            "purged %d expired dedupe keys from schema %r in %.1f ms",
            total,
            schema,
            (time.perf_counter() - started) * 1000,
        )
    return total
