"""The queue table's statements, one function each, so the broker and its consumers never hold SQL.

Every function takes an open connection and leaves the transaction to the caller: an insert
made on a bound connection joins the application's transaction, one made on a pooled
autocommit connection commits at once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg.rows import class_row, dict_row

from .. import _sql

__all__ = ["QueueCounts"]

Held = Sequence[tuple[int, int]]


@dataclasses.dataclass(frozen=True)
class ClaimedRow:
    """A row a consumer now holds: its id, the lease token it holds it by, and the message."""

    id: int
    lease: int
    body: bytes
    deliveries: int


@dataclasses.dataclass(frozen=True)
class QueueCounts:
    """One Postgres queue's numbers: ``ready`` to run now, ``delayed`` (an eta or a retry's
    backoff), ``held`` by a consumer, ``dead`` (nacked, kept as ``.XQ``), and the age of the
    oldest ready message."""

    queue_name: str
    ready: int
    delayed: int
    held: int
    dead: int
    oldest_ready_s: float | None

    @property
    def depth(self) -> int:
        """Messages not yet done: ready, delayed and held."""
        return self.ready + self.delayed + self.held


def insert(
    conn: psycopg.Connection[Any],
    schema: str,
    *,
    queue_name: str,
    message_id: str,
    actor_name: str,
    body: bytes,
    priority: int,
    eta_ms: int | None,
) -> None:
    conn.execute(
        _sql.rendered("queue_insert", schema),
        {
            "queue_name": queue_name,
            "message_id": message_id,
            "actor_name": actor_name,
            "body": body,
            "priority": priority,
            "eta_ms": eta_ms,
        },
    )


def claim(
    conn: psycopg.Connection[Any], schema: str, *, queue_name: str, limit: int, lease: int, lease_ms: int
) -> list[ClaimedRow]:
    rows = (
        conn.cursor(row_factory=dict_row)
        .execute(
            _sql.query("queue_claim", schema),
            {"queue_name": queue_name, "limit": limit, "lease": lease, "lease_s": lease_ms / 1000},
        )
        .fetchall()
    )
    return [
        ClaimedRow(id=row["id"], lease=lease, body=bytes(row["body"]), deliveries=row["deliveries"]) for row in rows
    ]


def next_due_s(conn: psycopg.Connection[Any], schema: str, queue_name: str) -> float | None:
    """Seconds until the next row of ``queue_name`` falls due (0 or less: due now; ``None``: the
    queue is empty), by the server's clock."""
    row = (
        conn.cursor(row_factory=dict_row)
        .execute(_sql.query("queue_next_due", schema), {"queue_name": queue_name})
        .fetchone()
    )
    return None if row is None or row["due_in_s"] is None else float(row["due_in_s"])


def _unzip(held: Held) -> dict[str, list[int]]:
    return {"ids": [row_id for row_id, _ in held], "leases": [lease for _, lease in held]}


def ack(conn: psycopg.Connection[Any], schema: str, held: Held) -> int:
    """Delete acked rows (only those still held by the given leases); the number deleted."""
    return conn.execute(_sql.query("queue_ack", schema), _unzip(held)).rowcount


def heartbeat(conn: psycopg.Connection[Any], schema: str, held: Held, *, lease_ms: int) -> int:
    """Extend the given leases; the number of rows still held."""
    return conn.execute(_sql.query("queue_heartbeat", schema), {**_unzip(held), "lease_s": lease_ms / 1000}).rowcount


def release(conn: psycopg.Connection[Any], schema: str, held: Held) -> int:
    """Make held rows visible again now (no redelivery wait)."""
    return conn.execute(_sql.query("queue_release", schema), _unzip(held)).rowcount


def nack(conn: psycopg.Connection[Any], schema: str, *, row_id: int, lease: int, xq_name: str) -> tuple[int, int]:
    """Take a failed message off its queue: (deleted because a dead letter holds it, kept as ``.XQ``)."""
    row = (
        conn.cursor(row_factory=dict_row)
        .execute(_sql.query("queue_nack", schema), {"id": row_id, "lease": lease, "xq_name": xq_name})
        .fetchone()
    )
    return (row["deleted"], row["kept"]) if row else (0, 0)


def retry_in_place(
    conn: psycopg.Connection[Any],
    schema: str,
    *,
    row_id: int,
    lease: int,
    body: bytes,
    priority: int,
    eta_ms: int | None,
) -> bool:
    """Turn the held row into its own retry; False if the lease was lost meanwhile."""
    cursor = conn.execute(
        _sql.query("queue_retry", schema),
        {"id": row_id, "lease": lease, "body": body, "priority": priority, "eta_ms": eta_ms},
    )
    return cursor.rowcount == 1


def pending(conn: psycopg.Connection[Any], schema: str, queue_name: str) -> int:
    """Messages of ``queue_name`` not yet done: waiting, delayed or held by a consumer."""
    cursor = conn.cursor(row_factory=dict_row)
    row = cursor.execute(_sql.query("queue_pending", schema), {"queue_name": queue_name}).fetchone()
    return int(row["pending"]) if row else 0


def flush(conn: psycopg.Connection[Any], schema: str, queue_names: Sequence[str]) -> int:
    """Delete every row of ``queue_names``, in whatever state; the number deleted."""
    return conn.execute(_sql.query("queue_flush", schema), {"queue_names": list(queue_names)}).rowcount


def purge_dead(conn: psycopg.Connection[Any], schema: str, *, older_than_ms: int, batch_size: int) -> int:
    return conn.execute(
        _sql.query("queue_purge_dead", schema), {"older_than_s": older_than_ms / 1000, "batch_size": batch_size}
    ).rowcount


def counts(conn: psycopg.Connection[Any], schema: str) -> list[QueueCounts]:
    """Every queue's numbers (dead ``.XQ`` rows folded into their queue), by queue name."""
    return conn.cursor(row_factory=class_row(QueueCounts)).execute(_sql.query("queue_stats", schema), {}).fetchall()
