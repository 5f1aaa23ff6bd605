"""Progress of a batch by id: n of m done, dead, pending, sealed, when its callback fired."""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

import psycopg
from psycopg.rows import dict_row

from .. import _sql
from ..database import Database, DatabaseLike
from ..errors import JobNotFound
from ..schema import BATCH_VERSION, ensure_ready

__all__ = ["BatchStatus", "batch_status"]


@dataclasses.dataclass(frozen=True)
class BatchStatus:
    """One batch's progress; ``done + dead + pending == total``."""

    id: str
    total: int
    done: int
    dead: int
    pending: int
    if_child_dies: str
    callback_actor: str
    created_at: datetime.datetime
    sealed_at: datetime.datetime | None
    fired_at: datetime.datetime | None
    #: ``None`` until it fired; ``"succeeded"`` (the callback was sent) or ``"failed"``.
    outcome: str | None

    @property
    def state(self) -> str:
        """``open`` (children may still be added), ``running``, ``succeeded`` or ``failed``."""
        if self.outcome is not None:
            return self.outcome
        return "open" if self.sealed_at is None else "running"

    def asdict(self) -> dict[str, Any]:
        """JSON-ready: timestamps as ISO 8601 strings."""
        out: dict[str, Any] = {"state": self.state}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            out[field.name] = value.isoformat() if isinstance(value, datetime.datetime) else value
        return out


def batch_status(
    database: DatabaseLike | psycopg.Connection[Any], schema: str = _sql.DEFAULT_SCHEMA, id: str = ""
) -> BatchStatus:
    """The progress of batch ``id``; raises :class:`~dramatiq_reliable.errors.JobNotFound` for an unknown id.

    One indexed read over the batch's counter shards, never over its children, so it costs the
    same for ten children or 100,000.  ``database`` is a URL, a pool, a ``Database`` or an open
    connection (then its transaction and snapshot are used).

    >>> batch_status(broker.database, broker.schema, batch.id).pending   # doctest: +SKIP
    0
    """
    schema = _sql.validate_schema(schema)
    if not isinstance(id, str) or not id or "\x00" in id:
        raise JobNotFound(f"batch id {id!r} is not a batch id; pass the id of Batch(...).id")
    if isinstance(database, psycopg.Connection):
        row = _read(database, schema, id)
    else:
        db = Database.of(database, max_size=1)
        try:
            with db.autocommit() as conn:
                row = _read(conn, schema, id)
        finally:
            if db is not database:
                db.close()
    if row is None:
        raise JobNotFound(
            f"no batch {id!r} in schema {schema!r}; check the id (Batch.id), and that the transaction that created "
            "it committed"
        )
    total, pending, dead = int(row["total"]), int(row["pending"]), int(row["dead"])
    return BatchStatus(
        id=row["id"],
        total=total,
        done=total - pending - dead,
        dead=dead,
        pending=pending,
        if_child_dies=row["if_child_dies"],
        callback_actor=row["callback_actor"],
        created_at=row["created_at"],
        sealed_at=row["sealed_at"],
        fired_at=row["fired_at"],
        outcome=row["outcome"],
    )


def _read(conn: psycopg.Connection[Any], schema: str, id: str) -> dict[str, Any] | None:
    ensure_ready(conn, schema=schema, required=BATCH_VERSION, feature="batches")
    return conn.cursor(row_factory=dict_row).execute(_sql.query("batch_status", schema), {"id": id}).fetchone()
