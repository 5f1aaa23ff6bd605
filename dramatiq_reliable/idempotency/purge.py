"""Retention: deleting expired keys in short batches, from the CLI or an actor of your own."""

from __future__ import annotations

import time
from typing import Any

import dramatiq
from dramatiq.broker import Broker

from .. import _sql, events
from ..backing import backing_of
from ..database import Database, DatabaseLike
from ..errors import (
    ConfigurationError,
)
from ..schema import IDEMPOTENCY_VERSION, ensure_ready
from ._connections import autocommit
from .events import IdempotencyKeysPurged
from .middleware import Idempotency

__all__ = ["make_purge_actor", "purge_expired"]

# -- retention ----------------------------------------------------------------------------------


def purge_expired(database: DatabaseLike, *, schema: str = _sql.DEFAULT_SCHEMA, batch_size: int = 5000) -> int:
    """Delete expired keys in batches of ``batch_size``; return how many were deleted.

    Each batch is its own short transaction, so a large backlog never holds long locks.  The
    ``dramatiq-reliable idempotency purge`` command and :func:`make_purge_actor` call this.
    """
    schema_name = _sql.validate_schema(schema)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigurationError(f"batch_size must be a positive int, got {batch_size!r}")
    database = Database.of(database)
    started = time.perf_counter()
    total = 0
    with database.connection() as conn:
        ensure_ready(conn, schema=schema_name, required=IDEMPOTENCY_VERSION, feature="idempotency")
        conn.rollback()
        with autocommit(conn):
            while True:
                deleted = conn.execute(
                    _sql.query("idempotency_purge", schema_name), {"batch_size": batch_size}
                ).rowcount
                total += deleted
                if deleted < batch_size:
                    break
    events.emit(IdempotencyKeysPurged(total, schema_name, (time.perf_counter() - started) * 1000))
    return total


def make_purge_actor(
    broker: Broker,
    *,
    database: DatabaseLike | None = None,
    schema: str | None = None,
    batch_size: int = 5000,
    actor_name: str = "dramatiq_reliable_purge_idempotency_keys",
    queue_name: str = "dramatiq_reliable",
    **actor_options: Any,
) -> dramatiq.Actor[[], int]:
    """Declare on ``broker`` an actor that purges expired keys, for your scheduler to send.

    The database and schema default to those of the broker's ``Idempotency`` middleware (or of
    the ``OutboxBroker``).  The actor itself runs with ``idempotency="off"``.

    >>> purge = make_purge_actor(broker)                              # doctest: +SKIP
    >>> scheduler.add_job(purge.send, "cron", hour=3)                 # doctest: +SKIP
    """
    if database is None:
        middleware = next((m for m in broker.middleware if isinstance(m, Idempotency)), None)
        if middleware is not None:
            database, default_schema = middleware.database_for(broker)
        else:
            backing = backing_of(broker, needed_by="make_purge_actor()")
            database, default_schema = backing.database, backing.schema
    else:
        backing = backing_of(broker, needed_by="make_purge_actor()", database=Database.of(database))
        database, default_schema = backing.database, backing.schema
    schema_name = _sql.validate_schema(schema or default_schema)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigurationError(f"batch_size must be a positive int, got {batch_size!r}")
    if "idempotency" in broker.actor_options:
        actor_options.setdefault("idempotency", "off")
    target = database

    def purge_idempotency_keys() -> int:
        return purge_expired(target, schema=schema_name, batch_size=batch_size)

    decorate = dramatiq.actor(actor_name=actor_name, queue_name=queue_name, broker=broker, **actor_options)
    return decorate(purge_idempotency_keys)
