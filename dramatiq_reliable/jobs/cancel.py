"""Cancelling a job by its message id, wherever it is: waiting in Postgres, in RabbitMQ, or running.

A job still waiting in Postgres (an unpublished outbox row, or a ``PostgresBroker`` queue row
no worker holds, delayed or waiting out a retry's backoff included) is deleted there, and the
cancellation is recorded in ``job_cancellations``, in one transaction: it can never run.

A job beyond Postgres's reach (published to RabbitMQ, held by a worker, running) gets a
*tombstone*: the same ``job_cancellations`` row.  The
:class:`~dramatiq_reliable.jobs.cancellation.Cancellation` middleware looks the message id up
before the actor runs and skips (acks) a tombstoned delivery, so it never runs; a running job
sees it through :func:`~dramatiq_reliable.is_cancelled` and stops at its next check.

A job that already finished (its processed-job key is stored, or it is dead) is left alone and
nothing is written: cancelling cannot undo work.  A message id Postgres has never heard of is
:data:`UNKNOWN`, also without a write, so a typo never leaves a tombstone behind.

>>> result = cancel_job(database, "dramatiq_reliable", "0b8f...", by="alice")   # doctest: +SKIP
>>> result.outcome, result.changed                                              # doctest: +SKIP
('outbox', True)
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any, Literal

import psycopg
from psycopg.rows import dict_row

from .. import _sql
from .._checks import check_text
from ..database import Database
from ..errors import DatabaseUnavailable
from ..schema import CANCEL_VERSION, ensure_ready

__all__ = [
    "ALREADY_CANCELLED",
    "FINISHED",
    "IN_FLIGHT",
    "OUTBOX",
    "QUEUE",
    "UNKNOWN",
    "CancelOutcome",
    "CancelRecord",
    "CancelResult",
    "cancel_job",
    "get_cancellation",
]

#: The outcomes of :func:`cancel_job`.  The first three cancel the job; the others change nothing.
CancelOutcome = Literal["outbox", "queue", "in_flight", "already_cancelled", "finished", "unknown"]
#: Its unpublished outbox row(s) were deleted: it never reaches RabbitMQ.
OUTBOX: CancelOutcome = "outbox"
#: Its ``PostgresBroker`` queue row(s) no worker held were deleted: no worker takes it.
QUEUE: CancelOutcome = "queue"
#: Published to RabbitMQ, held by a worker, or running: a tombstone was written.  A delivery is
#: skipped and acked; a running job stops at its next ``is_cancelled()``/``check_cancelled()``.
IN_FLIGHT: CancelOutcome = "in_flight"
#: It was cancelled before; the earlier cancellation (who, when) is returned unchanged.
ALREADY_CANCELLED: CancelOutcome = "already_cancelled"
#: It already ran to completion (processed-job key) or died (a dead letter): nothing changed.
FINISHED: CancelOutcome = "finished"
#: Postgres holds nothing of this message id: nothing changed.
UNKNOWN: CancelOutcome = "unknown"

#: The longest message id, ``by`` and ``reason`` accepted: Dramatiq's ids are 36 characters; a
#: longer value is a paste gone wrong, refused before it reaches the database.
MAX_ID_CHARS = 255
MAX_BY_CHARS = 200
MAX_REASON_CHARS = 2000


@dataclasses.dataclass(frozen=True)
class CancelRecord:
    """One cancelled message: who, when, why, where it was, and whether a worker honoured it."""

    message_id: str
    cancelled_at: datetime.datetime
    cancelled_by: str
    reason: str | None
    #: ``"outbox"``, ``"queue"`` (its row was deleted) or ``"in_flight"`` (a tombstone)
    found_in: str
    #: when a worker skipped a delivery of it (``"skipped"``) or its running job stopped (``"stopped"``)
    honoured_at: datetime.datetime | None = None
    honoured_how: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-able fields, times in ISO 8601."""
        data = dataclasses.asdict(self)
        for key in ("cancelled_at", "honoured_at"):
            if data[key] is not None:
                data[key] = data[key].isoformat()
        return data


@dataclasses.dataclass(frozen=True)
class CancelResult:
    """What :func:`cancel_job` found and did.  ``changed`` is true only when this call cancelled."""

    message_id: str
    outcome: CancelOutcome
    #: the cancellation this call wrote, or the earlier one for ``already_cancelled``; else ``None``
    cancellation: CancelRecord | None = None
    #: for ``finished``: ``"done"`` (processed-job key) or ``"dead"`` (a dead letter)
    finished_as: str | None = None
    #: how many rows were deleted (``outbox``/``queue``; a message and its pending retry are 2)
    removed: int = 0

    @property
    def changed(self) -> bool:
        return self.outcome in (OUTBOX, QUEUE, IN_FLIGHT)

    def describe(self) -> str:
        """One line for people: what happened to the job."""
        who = self.cancellation
        by = f" by {who.cancelled_by} at {who.cancelled_at:%Y-%m-%d %H:%M:%S %Z}".rstrip() if who else ""
        if self.outcome == OUTBOX:
            return f"cancelled{by}: removed from the outbox before it was published"
        if self.outcome == QUEUE:
            return f"cancelled{by}: removed from the Postgres queue before a worker took it"
        if self.outcome == IN_FLIGHT:
            return (
                f"cancelled{by}: it is in RabbitMQ or running, so a worker skips it on delivery "
                "and a running job stops at its next is_cancelled() check"
            )
        if self.outcome == ALREADY_CANCELLED:
            return f"already cancelled{by}; nothing changed"
        if self.outcome == FINISHED:
            return f"already finished ({self.finished_as}); nothing changed"
        return "no job with this message id in Postgres; nothing changed"

    def as_dict(self) -> dict[str, Any]:
        return {
            "message_id": self.message_id,
            "outcome": self.outcome,
            "changed": self.changed,
            "removed": self.removed,
            "finished_as": self.finished_as,
            "cancellation": self.cancellation.as_dict() if self.cancellation else None,
        }


def cancel_job(
    database: Database,
    schema: str,
    message_id: str,
    *,
    by: str,
    reason: str | None = None,
) -> CancelResult:
    """Cancel the job whose Dramatiq message id is ``message_id``; see the module for where it acts.

    Everything happens in one transaction on a pooled connection: the delete (if the job still
    waits in Postgres) and the ``job_cancellations`` row commit together.  A relay or a worker
    claiming the row at the same moment holds its lock; the delete waits for it and then finds
    the row published or leased, so the job is tombstoned instead: it is never both deleted and
    delivered.  Raises :class:`~dramatiq_reliable.errors.ConfigurationError` for a bad
    argument (before any SQL), ``SchemaNotReady`` before migration 12, and
    ``DatabaseUnavailable`` when Postgres cannot be reached.
    """
    schema = _sql.validate_schema(schema)
    check_text("message_id", message_id, max_chars=MAX_ID_CHARS, fix="pass the job's Dramatiq message id")
    check_text("by", by, max_chars=MAX_BY_CHARS, fix="pass who cancels, e.g. a user name")
    check_text("reason", reason, max_chars=MAX_REASON_CHARS, allow_none=True, fix="pass a short reason or None")
    try:
        with database.connection() as conn, conn.transaction():
            ensure_ready(conn, schema=schema, required=CANCEL_VERSION, feature="job cancellation")
            return _cancel(conn, schema, message_id, by, reason)
    except psycopg.OperationalError as error:
        raise DatabaseUnavailable(
            f"could not cancel job {message_id!r}: Postgres is unreachable ({error}); nothing changed, try again"
        ) from error


def cancel_in_transaction(
    conn: psycopg.Connection[Any], schema: str, message_id: str, *, by: str, reason: str | None = None
) -> CancelResult:
    """:func:`cancel_job` inside the caller's transaction on ``conn`` (a workflow's cancel: one commit).

    Arguments are not checked here: the caller has checked them, and the schema is ready.
    """
    return _cancel(conn, schema, message_id, by, reason)


def get_cancellation(conn: psycopg.Connection[Any], schema: str, message_id: str) -> CancelRecord | None:
    """The cancellation of ``message_id``, or ``None`` (for ``jobs show`` and the page)."""
    row = (
        conn.cursor(row_factory=dict_row)
        .execute(_sql.query("cancel_get", schema), {"message_id": message_id})
        .fetchone()
    )
    return _cancellation(row) if row else None


def _cancel(conn: psycopg.Connection[Any], schema: str, message_id: str, by: str, reason: str | None) -> CancelResult:
    params = {"message_id": message_id}
    earlier = get_cancellation(conn, schema, message_id)
    if earlier is not None:
        return CancelResult(message_id, ALREADY_CANCELLED, cancellation=earlier)
    cur = conn.cursor(row_factory=dict_row)
    for outcome, name in ((OUTBOX, "cancel_outbox_delete"), (QUEUE, "cancel_queue_delete")):
        removed = cur.execute(_sql.query(name, schema), params).fetchall()
        if removed:
            return _record(conn, schema, message_id, by, reason, outcome, removed=len(removed))
    where = cur.execute(_sql.query("cancel_where", schema), params).fetchone()
    assert where is not None
    if where["done"]:
        return CancelResult(message_id, FINISHED, finished_as="done")
    if where["dead"] or where["dead_in_queue"]:
        return CancelResult(message_id, FINISHED, finished_as="dead")
    if where["in_outbox"] or where["in_queue"] or where["leased"] or where["handled_dead_letters"]:
        return _record(conn, schema, message_id, by, reason, IN_FLIGHT)
    return CancelResult(message_id, UNKNOWN)


def _record(
    conn: psycopg.Connection[Any],
    schema: str,
    message_id: str,
    by: str,
    reason: str | None,
    outcome: CancelOutcome,
    *,
    removed: int = 0,
) -> CancelResult:
    values = {"message_id": message_id, "cancelled_by": by, "reason": reason, "found_in": outcome}
    inserted = conn.cursor(row_factory=dict_row).execute(_sql.query("cancel_insert", schema), values).fetchone()
    if inserted is None:
        # A concurrent cancel of the same message committed first (the earlier look-up missed
        # it): its row stands.  Whatever this call deleted was cancelled by it either way.
        row = get_cancellation(conn, schema, message_id)
        return CancelResult(message_id, ALREADY_CANCELLED, cancellation=row)
    cancellation = CancelRecord(
        message_id=message_id,
        cancelled_at=inserted["cancelled_at"],
        cancelled_by=by,
        reason=reason,
        found_in=outcome,
    )
    return CancelResult(message_id, outcome, cancellation=cancellation, removed=removed)


def _cancellation(row: dict[str, Any]) -> CancelRecord:
    return CancelRecord(
        message_id=row["message_id"],
        cancelled_at=row["cancelled_at"],
        cancelled_by=row["cancelled_by"],
        reason=row["reason"],
        found_in=row["found_in"],
        honoured_at=row["honoured_at"],
        honoured_how=row["honoured_how"],
    )
