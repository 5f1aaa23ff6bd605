"""Retention of the queue table: acked rows are deleted at once, dead ``.XQ`` rows after a while.

The table holds only live messages and the dead ones nobody stored elsewhere, so it stays as
small as the backlog; autovacuum (tuned on the table to run after 1% of it is dead) reclaims the
deleted rows.  Each broker purges old dead rows every few minutes from its heartbeat thread;
:func:`purge_dead` is the same for a cron job or a script.
"""

from __future__ import annotations

from typing import Any

import psycopg

from .. import _sql
from .._checks import check_int, check_ms
from . import queue

__all__ = ["purge_dead"]


def purge_dead(
    conn: psycopg.Connection[Any],
    *,
    schema: str = _sql.DEFAULT_SCHEMA,
    older_than_ms: int,
    batch_size: int = 5000,
) -> int:
    """Delete dead ``.XQ`` rows older than ``older_than_ms``, ``batch_size`` per statement; the number deleted.

    Run it on an autocommit connection: each batch commits on its own, so a long purge never
    holds a large transaction open.
    """
    _sql.validate_schema(schema)
    check_int("batch_size", batch_size, minimum=1, fix="e.g. batch_size=5000")
    check_ms("older_than_ms", older_than_ms, fix="e.g. 7 days, older_than_ms=604800000")
    total = 0
    while True:
        deleted = queue.purge_dead(conn, schema, older_than_ms=older_than_ms, batch_size=batch_size)
        total += deleted
        if deleted < batch_size:
            return total
