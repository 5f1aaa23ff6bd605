"""Retention: an actor that deletes expired keys, for your scheduler to send (the statements are in :mod:`.store`)."""

from __future__ import annotations

from typing import Any

import dramatiq
from dramatiq.broker import Broker

from .. import _sql
from .._checks import check_int
from ..backing import backing_of
from ..database import Database, DatabaseLike
from .middleware import Idempotency
from .store import purge_expired

__all__ = ["make_purge_actor"]


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
    check_int("batch_size", batch_size, minimum=1, fix="e.g. batch_size=5000")
    if "idempotency" in broker.actor_options:
        actor_options.setdefault("idempotency", "off")
    target = database

    def purge_idempotency_keys() -> int:
        return purge_expired(target, schema=schema_name, batch_size=batch_size)

    decorate = dramatiq.actor(actor_name=actor_name, queue_name=queue_name, broker=broker, **actor_options)
    return decorate(purge_idempotency_keys)
