"""Progress of a batch by id: n of m done, dead, pending, sealed, when its callback fired; and its cancel.

Also what the web page lists: the newest batches (:func:`list_batches`), one batch's children
and their states (:func:`batch_children`), and the batch a job belongs to (:func:`batch_of_job`).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from typing import Any

import psycopg
from psycopg.rows import dict_row

from .. import _sql
from .._checks import check_choice, check_int, check_text
from ..database import Database, DatabaseLike
from ..errors import DatabaseUnavailable, JobNotFound
from ..jobs.cancel import MAX_BY_CHARS, MAX_REASON_CHARS, CancelResult, cancel_in_transaction
from ..schema import BATCH_CANCEL_VERSION, current_version, ensure_ready, table_exists
from .batch import BATCH_OPTION

# list_batches, batch_children and batch_of_job are the web page's (internal, as jobs.detail is);
# the public way to read a batch is batch_status().
__all__ = ["BatchCancel", "BatchStatus", "batch_status", "cancel_batch"]

#: The states :func:`list_batches` filters by (``BatchStatus.state``).
BATCH_STATES = ("open", "running", "succeeded", "failed", "cancelled")
#: The states of one child (``batch_children``'s ``state`` column).
CHILD_STATES = ("pending", "done", "dead", "cancelled")
#: The reads need the cancel's columns (migration 21); sending a batch needs 15.
_READ_VERSION = BATCH_CANCEL_VERSION


@dataclasses.dataclass(frozen=True)
class BatchStatus:
    """One batch's progress; ``done + dead + pending == total``.

    After a cancel, ``pending`` still counts the children that had not finished (each of them
    ``cancelled`` in :func:`batch_children`): the counters are left as they were (see
    :func:`cancel_batch`).
    """

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
    #: ``None`` until it fired; ``"succeeded"`` (the callback was sent), ``"failed"`` or ``"cancelled"``.
    outcome: str | None
    #: who cancelled it (:func:`cancel_batch`), when and why; ``None`` unless cancelled
    cancelled_at: datetime.datetime | None = None
    cancelled_by: str | None = None
    cancel_reason: str | None = None

    @property
    def state(self) -> str:
        """``open`` (children may still be added), ``running``, ``succeeded``, ``failed`` or ``cancelled``."""
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
        raise _missing(id, schema)
    return _status(row)


def _missing(id: str, schema: str) -> JobNotFound:
    return JobNotFound(
        f"no batch {id!r} in schema {schema!r}; check the id (Batch.id), and that the transaction that created "
        "it committed"
    )


def _status(row: dict[str, Any]) -> BatchStatus:
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
        cancelled_at=row["cancelled_at"],
        cancelled_by=row["cancelled_by"],
        cancel_reason=row["cancel_reason"],
    )


def _read(conn: psycopg.Connection[Any], schema: str, id: str) -> dict[str, Any] | None:
    ensure_ready(conn, schema=schema, required=_READ_VERSION, feature="batches")
    return conn.cursor(row_factory=dict_row).execute(_sql.query("batch_status", schema), {"id": id}).fetchone()


@dataclasses.dataclass(frozen=True)
class BatchChild:
    """One child of a batch: its message id (the job page's id), ``pending``/``done``/``dead``/``cancelled``, when it finished."""

    message_id: str
    state: str
    finished_at: datetime.datetime | None


def list_batches(
    database: Database, schema: str = _sql.DEFAULT_SCHEMA, *, state: str | None = None, limit: int = 50
) -> list[BatchStatus]:
    """The newest ``limit`` batches, or those in ``state`` (``open``, ``running``, ``succeeded``, ``failed``, ``cancelled``).

    Each row's counts are summed over its shards, as :func:`batch_status` sums them.
    """
    schema = _sql.validate_schema(schema)
    if state is not None:
        check_choice("state", state, BATCH_STATES, fix="or None for every batch")
    check_int("limit", limit, minimum=1, maximum=10_000)
    with database.autocommit() as conn:
        ensure_ready(conn, schema=schema, required=_READ_VERSION, feature="batches")
        query = _sql.query("batch_list", schema)
        rows = conn.cursor(row_factory=dict_row).execute(query, {"state": state, "limit": limit}).fetchall()
    return [_status(row) for row in rows]


def batch_children(
    database: Database, schema: str = _sql.DEFAULT_SCHEMA, id: str = "", *, state: str | None = None, limit: int = 50
) -> list[BatchChild]:
    """Up to ``limit`` children of batch ``id`` (or those in ``state``): dead first, then pending, then done.

    The order puts what keeps a batch from finishing on top; it reads (and sorts) every child of
    the batch matching ``state``, through the children's primary key.
    """
    schema = _sql.validate_schema(schema)
    if state is not None:
        check_choice("state", state, CHILD_STATES, fix="or None for every child")
    check_int("limit", limit, minimum=1, maximum=10_000)
    with database.autocommit() as conn:
        ensure_ready(conn, schema=schema, required=_READ_VERSION, feature="batches")
        cursor = conn.cursor(row_factory=dict_row)
        rows = cursor.execute(
            _sql.query("batch_children", schema), {"id": id, "state": state, "limit": limit}
        ).fetchall()
    return [
        BatchChild(message_id=row["message_id"], state=row["state"], finished_at=row["finished_at"]) for row in rows
    ]


def batch_of_job(database: Database, schema: str, message_id: str) -> tuple[str, str] | None:
    """``(batch id, the child's state)`` for a job that is a batch's child, else ``None``.

    From migration 21, one read of the children's ``message_id`` index: found whatever became of
    the message (a child that finished on a ``PostgresBroker`` has no queue row left).  Before
    it, through the message's ``batch_id`` option where Postgres still holds a copy of the
    message (a waiting or retained outbox row, a queue row, its dead letter).  ``None`` too before
    the batches migration.
    """
    schema = _sql.validate_schema(schema)
    with database.autocommit() as conn:
        version = current_version(conn, schema=schema)
        if version is not None and version >= BATCH_CANCEL_VERSION:
            found = (
                conn.cursor(row_factory=dict_row)
                .execute(_sql.query("batch_of_child", schema), {"message_id": message_id})
                .fetchone()
            )
            return None if found is None else (str(found["batch_id"]), str(found["state"]))
        if not table_exists(conn, schema, "batch_children"):
            return None
        cursor = conn.cursor(row_factory=dict_row)
        for row in cursor.execute(_sql.query("batch_of_job", schema), {"message_id": message_id}).fetchall():
            batch_id = _batch_option(row["body"], row["message"])
            if batch_id is None:
                continue
            params = {"batch_id": batch_id, "message_id": message_id}
            child = cursor.execute(_sql.query("batch_child_state", schema), params).fetchone()
            if child is not None:
                return batch_id, str(child["state"])
    return None


def _batch_option(body: bytes | None, message: Any) -> str | None:
    """The ``batch_id`` option of a stored message (an encoded body, or a dead letter's JSON); a
    body another encoder wrote, or that is not an object, has none."""
    if body is not None:
        try:
            message = json.loads(body)
        except ValueError:
            return None
    options = message.get("options") if isinstance(message, dict) else None
    value = options.get(BATCH_OPTION) if isinstance(options, dict) else None
    return value if isinstance(value, str) and value else None


@dataclasses.dataclass(frozen=True)
class BatchCancel:
    """What :func:`cancel_batch` did: ``changed`` only when this call cancelled the batch."""

    id: str
    changed: bool
    #: the batch's state after the call: ``cancelled``, or the outcome it had finished with
    state: str
    #: the job cancel of each child that had not finished (deleted where it waited, or tombstoned)
    jobs: tuple[CancelResult, ...]

    def asdict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "id": self.id,
            "changed": self.changed,
            "state": self.state,
            "jobs": [job.as_dict() for job in self.jobs],
        }


def cancel_batch(
    database: DatabaseLike | psycopg.Connection[Any],
    schema: str = _sql.DEFAULT_SCHEMA,
    id: str = "",
    *,
    by: str,
    reason: str | None = None,
) -> BatchCancel:
    """Cancel batch ``id``: its callback never fires, nor its ``on_failure``, and every child not finished is cancelled.

    One transaction, under the batch's row lock: the batch becomes ``cancelled`` (and sealed,
    so no child is added to it later), each child not finished is marked ``cancelled`` and goes
    through the job cancel (deleted from the outbox or queue, or tombstoned for the
    ``Cancellation`` middleware).  A child finishing at that moment is not waited for (it holds
    its own row and would wait for the batch's: a deadlock); it commits as done, and fires
    nothing, as every child finishing later does.  ``on_failure`` is not sent: it says "a child
    died", which a cancel is not, and whoever cancels knows already.  A batch that had finished
    changes nothing.  ``database`` is a URL, a pool, a ``Database``, or an open connection
    (then the caller's transaction, committed by the caller).  Raises ``JobNotFound`` for an
    unknown id, ``ConfigurationError`` for a bad ``by`` or ``reason``.

    >>> cancel_batch(broker.database, broker.schema, batch.id, by="alice").changed   # doctest: +SKIP
    True
    """
    schema = _sql.validate_schema(schema)
    if not isinstance(id, str) or not id or "\x00" in id:
        raise JobNotFound(f"batch id {id!r} is not a batch id; pass the id of Batch(...).id")
    check_text("by", by, max_chars=MAX_BY_CHARS, fix="pass who cancels, e.g. a user name")
    check_text("reason", reason, max_chars=MAX_REASON_CHARS, allow_none=True, fix="pass a short reason or None")

    def cancel(conn: psycopg.Connection[Any]) -> BatchCancel:
        ensure_ready(conn, schema=schema, required=BATCH_CANCEL_VERSION, feature="cancelling a batch")
        cur = conn.cursor(row_factory=dict_row)
        params = {"id": id, "by": by, "reason": reason}
        if cur.execute(_sql.query("batch_cancel", schema), params).fetchone() is None:
            found = _read(conn, schema, id)
            if found is None:
                raise _missing(id, schema)
            return BatchCancel(id=id, changed=False, state=_status(found).state, jobs=())
        children = [row["message_id"] for row in cur.execute(_sql.query("batch_cancel_children", schema), params)]
        jobs = tuple(cancel_in_transaction(conn, schema, child, by=by, reason=reason) for child in children)
        return BatchCancel(id=id, changed=True, state="cancelled", jobs=jobs)

    try:
        if isinstance(database, psycopg.Connection):
            return cancel(database)
        db = Database.of(database, max_size=1)
        try:
            with db.connection() as conn, conn.transaction():
                return cancel(conn)
        finally:
            if db is not database:
                db.close()
    except psycopg.OperationalError as error:
        raise DatabaseUnavailable(
            f"could not cancel batch {id!r}: Postgres is unreachable ({error}); nothing changed, try again"
        ) from error
