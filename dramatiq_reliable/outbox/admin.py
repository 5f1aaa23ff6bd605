"""Operating the outbox: its backlog at a glance, the rows that fail on their own, and a fresh start for them.

The functions the ``outbox stats`` and ``outbox retry`` commands and the web page call, so both
read and act the same way.  Each takes an open connection with no transaction in progress and
leaves it so (reads end with a rollback, the retry commits its one statement).
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

import psycopg

from .. import _sql, schema

__all__ = ["FailingRow", "OutboxStats", "failing_rows", "outbox_stats", "retry_failing"]


@dataclasses.dataclass(frozen=True)
class OutboxStats:
    """Rows waiting for the relay, those of them that failed on their own, and the oldest one's age."""

    backlog: int
    failing: int
    oldest_age_s: float


@dataclasses.dataclass(frozen=True)
class FailingRow:
    """An unpublished row that failed on its own: how often, why last, and when it is tried again."""

    id: int
    message_id: str
    queue_name: str
    actor_name: str
    attempts: int
    last_error: str | None
    age_s: float
    available_at: datetime.datetime


def outbox_stats(conn: psycopg.Connection[Any], *, schema_name: str = _sql.DEFAULT_SCHEMA) -> OutboxStats:
    """The backlog, failing rows and oldest unpublished age (``SchemaNotReady`` without the outbox)."""
    with conn.transaction():
        _ready(conn, schema_name)
        row = _sql.tuples(conn).execute(_sql.query("outbox_stats", schema_name)).fetchone()
    assert row is not None
    return OutboxStats(backlog=int(row[0]), failing=int(row[1]), oldest_age_s=round(float(row[2]), 3))


def failing_rows(
    conn: psycopg.Connection[Any], *, schema_name: str = _sql.DEFAULT_SCHEMA, limit: int = 50
) -> list[FailingRow]:
    """Up to ``limit`` unpublished rows that failed on their own, most attempts first."""
    with conn.transaction():
        _ready(conn, schema_name)
        rows = _sql.tuples(conn).execute(_sql.query("outbox_failing_rows", schema_name), {"limit": limit}).fetchall()
    return [
        FailingRow(
            id=int(row[0]),
            message_id=row[1],
            queue_name=row[2],
            actor_name=row[3],
            attempts=int(row[4]),
            last_error=row[5],
            age_s=round(float(row[6]), 3),
            available_at=row[7],
        )
        for row in rows
    ]


def retry_failing(conn: psycopg.Connection[Any], *, schema_name: str = _sql.DEFAULT_SCHEMA) -> int:
    """Reset the attempts of every unpublished row that failed on its own (those the relay stopped
    trying after ``max_attempts`` included), so its next pass publishes them; return how many."""
    with conn.transaction():
        _ready(conn, schema_name)
        return int(conn.execute(_sql.query("outbox_retry", schema_name)).rowcount)


def _ready(conn: psycopg.Connection[Any], schema_name: str) -> None:
    schema.ensure_ready(conn, schema=schema_name, required=schema.OUTBOX_VERSION, feature="outbox")
