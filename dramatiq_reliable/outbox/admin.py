"""Operating the outbox: its backlog at a glance, the rows that fail on their own, and a fresh start for them.

The functions the ``outbox stats``, ``outbox retry`` and ``outbox purge`` commands, the relay's
progress line and the web page call, so they read and act the same way.  Each takes an open
connection with no transaction in progress and leaves it so (reads end with a rollback, the
retry commits its one statement and, if it reset rows, a wake-up of the relays).  The purge
itself is :func:`~dramatiq_reliable.outbox.purge_published`, which the relay runs too.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

import psycopg
from psycopg.rows import dict_row

from .. import _sql, schema
from .._checks import check_int, check_ms
from .wake import wake_relays

__all__ = ["FailingRow", "OutboxStats", "failing_rows", "outbox_stats", "published_older_than", "retry_failing"]


@dataclasses.dataclass(frozen=True)
class OutboxStats:
    """Rows waiting for the relay, those of them that failed on their own, and the oldest one's age.

    ``backlog`` counts rows due now (or failing); ``scheduled`` the rows waiting for their due
    time (delayed sends, retries' backoff), which are no backlog.  ``oldest_age_s`` counts from
    when the oldest backlog row fell due.
    """

    backlog: int
    failing: int
    oldest_age_s: float
    scheduled: int = 0


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


def outbox_stats(
    conn: psycopg.Connection[Any], *, schema_name: str = _sql.DEFAULT_SCHEMA, statement_timeout_ms: int | None = None
) -> OutboxStats:
    """The backlog, failing rows and oldest unpublished age (``SchemaNotReady`` without the outbox).

    ``statement_timeout_ms`` bounds the read server-side, for callers that would rather say
    "unknown" than wait (the relay's progress line).
    """
    check_ms("statement_timeout_ms", statement_timeout_ms, minimum=1, maximum=_INT_MAX, allow_none=True)
    with conn.transaction():
        if statement_timeout_ms is not None:
            _sql.set_local_timeouts(conn, statement_timeout_ms=statement_timeout_ms)
        _ready(conn, schema_name)
        row = conn.cursor(row_factory=dict_row).execute(_sql.query("outbox_stats", schema_name)).fetchone()
    assert row is not None
    return OutboxStats(
        backlog=int(row["backlog"]),
        failing=int(row["failing"]),
        oldest_age_s=round(float(row["oldest_age_s"]), 3),
        scheduled=int(row["scheduled"]),
    )


def failing_rows(
    conn: psycopg.Connection[Any], *, schema_name: str = _sql.DEFAULT_SCHEMA, limit: int = 50
) -> list[FailingRow]:
    """Up to ``limit`` unpublished rows that failed on their own, most attempts first."""
    check_int("limit", limit, minimum=1, maximum=_BIGINT_MAX)
    with conn.transaction():
        _ready(conn, schema_name)
        rows = (
            conn.cursor(row_factory=dict_row)
            .execute(_sql.query("outbox_failing_rows", schema_name), {"limit": limit})
            .fetchall()
        )
    return [
        FailingRow(
            id=int(row["id"]),
            message_id=row["message_id"],
            queue_name=row["queue_name"],
            actor_name=row["actor_name"],
            attempts=int(row["attempts"]),
            last_error=row["last_error"],
            age_s=round(float(row["age_s"]), 3),
            available_at=row["available_at"],
        )
        for row in rows
    ]


def published_older_than(
    conn: psycopg.Connection[Any], *, schema_name: str = _sql.DEFAULT_SCHEMA, older_than_ms: int
) -> int:
    """How many published rows :func:`~dramatiq_reliable.outbox.purge_published` would delete now.

    What ``outbox purge`` counts before it asks; read on the published-rows index.
    """
    check_ms("older_than_ms", older_than_ms)
    with conn.transaction():
        _ready(conn, schema_name)
        row = (
            conn.cursor(row_factory=dict_row)
            .execute(_sql.query("outbox_purge_count", schema_name), {"older_than_s": older_than_ms / 1000})
            .fetchone()
        )
    assert row is not None
    return int(row["published"])


def retry_failing(conn: psycopg.Connection[Any], *, schema_name: str = _sql.DEFAULT_SCHEMA) -> int:
    """Reset the attempts of every unpublished row that failed on its own (those the relay stopped
    trying after ``max_attempts`` included), so its next pass publishes them; return how many.  Wakes the relays when it reset any."""
    with conn.transaction():
        _ready(conn, schema_name)
        reset = int(conn.execute(_sql.query("outbox_retry", schema_name)).rowcount)
        if reset:
            # Delivered on commit: idle relays pass at once instead of at their next probe.
            wake_relays(conn, schema=schema_name)
        return reset


#: Postgres's bigint: the largest LIMIT.
_BIGINT_MAX = 2**63 - 1
#: Postgres's integer: the largest statement_timeout, in milliseconds.
_INT_MAX = 2**31 - 1


def _ready(conn: psycopg.Connection[Any], schema_name: str) -> None:
    schema.ensure_ready(conn, schema=schema_name, required=schema.OUTBOX_VERSION, feature="outbox")
