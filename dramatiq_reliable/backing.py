"""The seam between a Postgres-backed broker and every part of the package that needs its Postgres.

A broker is *Postgres-backed* when ``actor.send()`` writes a row in a Postgres transaction:
``OutboxBroker`` writes to the outbox (a relay publishes it to RabbitMQ), ``PostgresBroker`` to
its queue table (its workers claim it).  Everything else that needs Postgres (idempotency keys
and their purge, singleton leases, dead letters and their replays, the scheduler, the relay,
the tracing gauges, the web page) asks :func:`backing_of` where that is, and never which broker
class it was given.  A third broker plugs in by meeting :class:`PostgresBacked`: the parts then
share its pool and schema, and replays and scheduled ticks go where its sends go.

>>> backing = backing_of(broker, needed_by="DeadLetters")          # doctest: +SKIP
>>> backing.database, backing.schema, backing.sends_to             # doctest: +SKIP
(<Database ...>, 'dramatiq_reliable', 'outbox')
"""

from __future__ import annotations

import dataclasses
from contextlib import AbstractContextManager
from typing import Any, Literal, Protocol, runtime_checkable

import psycopg
import psycopg.sql
from dramatiq.message import Message
from psycopg.rows import dict_row

from . import _sql
from .database import Database
from .errors import ConfigurationError, TargetUnknown

__all__ = [
    "SENDS_TO",
    "Backing",
    "PostgresBacked",
    "SendsTo",
    "backing_of",
    "postgres_backed",
    "sends_to_of_schema",
]

#: Where a Postgres-backed broker's sends go: ``"outbox"`` (rows a relay publishes to RabbitMQ)
#: or ``"queue"`` (rows of the Postgres queue table, claimed by ``PostgresBroker`` workers).
SendsTo = Literal["outbox", "queue"]
SENDS_TO: tuple[SendsTo, ...] = ("outbox", "queue")


@runtime_checkable
class PostgresBacked(Protocol):
    """The contract of a broker whose ``send()`` is a row in a Postgres transaction.

    ``database`` and ``schema`` say where the tables are; ``sends_to`` names the table a send
    writes to, which is also where a dead letter's replay and a scheduled tick go, so they
    reach the same workers.  ``transaction()`` opens a pooled connection in a transaction and
    binds it, so every ``send()`` inside joins it.  ``enqueue`` writes the message in the bound
    transaction (or, unbound, commits it on its own) and refuses a bad message with
    :class:`~dramatiq_reliable.PayloadError` before any SQL, leaving the caller's transaction
    as it was.  ``OutboxBroker`` and ``PostgresBroker`` meet it through
    :class:`~dramatiq_reliable.sending.RowSending`.
    """

    database: Database
    schema: str
    sends_to: SendsTo

    def transaction(self) -> AbstractContextManager[psycopg.Connection[Any]]: ...

    def enqueue(self, message: Message[Any], *, delay: int | None = None) -> Message[Any]: ...


@dataclasses.dataclass(frozen=True)
class Backing:
    """Where a part keeps its rows: the pool, the schema, and where its sends and replays go.

    ``broker`` is the Postgres-backed broker they came from, or ``None`` when the part was
    given its own ``database=`` on a broker that is not Postgres-backed.
    """

    database: Database
    schema: str
    sends_to: SendsTo
    broker: PostgresBacked | None = None


def postgres_backed(broker: object) -> PostgresBacked | None:
    """``broker`` if it meets :class:`PostgresBacked`, else ``None``."""
    if isinstance(broker, PostgresBacked) and broker.sends_to in SENDS_TO:
        return broker
    return None


def sends_to_of_schema(conn: psycopg.Connection[Any], schema: str) -> SendsTo | None:
    """Where the deployment using ``schema`` sends, read from its tables, for code given no broker.

    ``"outbox"`` when only the outbox was ever written to, ``"queue"`` when only the queue
    table was; ``None`` when it cannot be told: nothing sent yet, both used (a move from one
    broker to the other), or sequences the role may not read.  Commands that write a message
    (a replay, a manual schedule run) then ask for ``--to`` instead of guessing: a replay into
    the outbox of a deployment without a relay would wait there for ever.
    """
    from . import schema as _schema

    used: dict[str, bool | None] = {}
    for table in SENDS_TO:
        if not _schema.table_exists(conn, schema, table):
            used[table] = False
            continue
        name = psycopg.sql.Identifier(schema, table).as_string(conn)
        row = conn.cursor(row_factory=dict_row).execute(_sql.query("table_used", schema), {"table": name}).fetchone()
        used[table] = None if row is None or row["used"] is None else bool(row["used"])
    if None in used.values():
        return None
    found = [table for table in SENDS_TO if used[table]]
    return found[0] if len(found) == 1 else None


def target_unknown(what: str, schema: str, *, outbox: str = "'outbox'", queue: str = "'queue'") -> TargetUnknown:
    """The error for a write whose target was not given and that :func:`sends_to_of_schema` cannot tell."""
    return TargetUnknown(
        f"cannot tell where {what} go in schema {schema!r}: the outbox and the Postgres queue table are both in "
        f"use, or neither was written to yet; pass {outbox} (OutboxBroker: a relay publishes them) or {queue} "
        "(PostgresBroker: its workers take them from the queue table)"
    )


def backing_of(
    broker: object,
    *,
    needed_by: str,
    database: Database | None = None,
    schema: str | None = None,
    error: type[ConfigurationError] = ConfigurationError,
) -> Backing:
    """The database, schema and send target that ``needed_by`` uses on ``broker``.

    A part given its own ``database=`` uses it; its schema defaults to the broker's (when the
    broker is Postgres-backed) and else to ``dramatiq_reliable``.  Without one it shares the
    broker's pool.  With neither, raises ``error`` naming the fix.
    """
    backed = postgres_backed(broker)
    if database is None:
        if backed is None:
            raise error(
                f"{needed_by} has no database on a {type(broker).__name__}; pass database='postgresql://...', "
                "or use a Postgres-backed broker (OutboxBroker or PostgresBroker), whose pool it then shares"
            )
        database = backed.database
    if schema is None:
        schema = backed.schema if backed is not None else _sql.DEFAULT_SCHEMA
    return Backing(
        database=database,
        schema=_sql.validate_schema(schema),
        sends_to=backed.sends_to if backed is not None else "outbox",
        broker=backed,
    )
