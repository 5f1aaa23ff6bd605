"""Checkpoints: the watermark of an incremental job, read and advanced in the job's own transaction.

A job that processes "everything changed since the last successful run" needs to know where the
last successful run stopped.  Kept in a file or a cache, that mark commits apart from the job's
writes: a crash between the two either skips work (mark first) or repeats it without knowing.
Here the mark is a row of ``checkpoints``, locked and updated on the job's transaction, so the
idempotency key, the job's writes and the new watermark commit together or not at all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

import psycopg

from . import _sql
from .errors import CheckpointError, NoCurrentJob, SchemaNotReady
from .idempotency.context import current_running

__all__ = ["CheckpointWindow", "checkpoint"]

W = TypeVar("W", dt.datetime, int)

_BIGINT = (-(2**63), 2**63 - 1)
_MAX_NAME_CHARS = 200


@dataclasses.dataclass(eq=False)
class CheckpointWindow(Generic[W]):
    """The interval one run of an incremental job owns, handed out by :func:`checkpoint`.

    Timestamp watermarks: process rows changed in ``[since, until)``; ``until`` is the database
    clock when the checkpoint's row lock was obtained (minus ``lag_ms``).  Integer watermarks:
    process ids above ``since`` and report the highest one handled with ``advance(to=...)``;
    ``until`` is ``None`` (the job knows its last id, the database clock does not).
    """

    name: str
    since: W
    until: W | None
    _to: W | None = None

    @property
    def watermark(self) -> W:
        """What the block records when it ends without an error."""
        if self._to is not None:
            return self._to
        if self.until is not None:
            return self.until
        return self.since

    def advance(self, *, to: W) -> None:
        """Record ``to`` as the new watermark (instead of ``until``) when the block ends without error.

        Call it with the last item handled when a run stops early (a batch limit), so the next
        run resumes there.  It never moves backwards: ``to`` below the current watermark, or a
        timestamp beyond ``until`` (changes this run has not looked at), is refused.
        """
        _check_type(self.name, to, type(self.since), "advance(to=...)")
        floor = self._to if self._to is not None else self.since
        if to < floor:
            raise CheckpointError(
                f"checkpoint {self.name!r} cannot move backwards from {floor!r} to {to!r}; "
                "pass the highest watermark this run has handled"
            )
        if self.until is not None and to > self.until:
            raise CheckpointError(
                f"checkpoint {self.name!r} cannot advance to {to!r}, past the end of its window {self.until!r}; "
                "changes after 'until' were not looked at by this run: pass a value up to window.until"
            )
        self._to = to


@contextlib.contextmanager
def checkpoint(
    name: str,
    *,
    initial: W,
    conn: psycopg.Connection[Any] | None = None,
    schema: str | None = None,
    lag_ms: int = 0,
) -> Iterator[CheckpointWindow[W]]:
    """Lock checkpoint ``name``, hand the block its window, and record the new watermark with the job.

    Inside an actor running under ``Idempotency`` with ``idempotency="transactional"`` it works
    on :func:`~dramatiq_reliable.job_connection`; elsewhere pass ``conn=``.  The block runs in a
    savepoint of that connection's transaction (or in a transaction of its own that commits when
    the block ends, if none is open), so:

    - **overlap**: the checkpoint row stays locked ``FOR UPDATE`` until the job's transaction
      ends; a second run of the same checkpoint waits, then reads the watermark the first one
      committed.  Two runs never both process one window.
    - **rollback**: an error out of the block, or a job transaction that does not commit (a
      failed job, a worker killed mid-run, a ``COMMIT`` whose outcome is unknown), leaves the
      watermark where it was; the next run or retry gets the same window again.  Work is
      repeated, never skipped, so make the job's writes idempotent (upserts).

    ``initial`` is the watermark before the first run; its type (an aware ``datetime`` or an
    ``int``) is the checkpoint's type.  ``lag_ms`` holds ``until`` back behind the database clock
    for rows whose timestamp is set before their transaction commits (``updated_at = now()``).

    >>> @dramatiq.actor(idempotency="transactional")                       # doctest: +SKIP
    ... def sync_orders():
    ...     with checkpoint("orders-sync", initial=EPOCH) as window:
    ...         copy_orders_changed_between(job_connection(), window.since, window.until)
    """
    name = _check_name(name)
    kind = _kind_of(name, initial)
    if not isinstance(lag_ms, int) or isinstance(lag_ms, bool) or lag_ms < 0:
        raise CheckpointError(f"lag_ms must be an int >= 0, got {lag_ms!r}; pass e.g. lag_ms=5000")
    running = current_running.get()
    if conn is None:
        if running is None or running.conn is None:
            where = "outside a job" if running is None else f"in a job of mode {running.job.mode!r}"
            raise NoCurrentJob(
                f"checkpoint({name!r}) was called {where} with no conn=; call it from an actor with "
                "idempotency='transactional' under the Idempotency middleware, or pass conn="
            )
        conn = running.conn
    elif not isinstance(conn, psycopg.Connection):
        raise CheckpointError(
            f"conn must be a psycopg Connection, got {type(conn).__name__!r}; pass conn=None in a job"
        )
    if conn.closed:
        raise CheckpointError(f"checkpoint({name!r}) was given a closed connection; pass an open one")
    if conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR:
        raise CheckpointError(
            f"checkpoint({name!r}) was given a connection whose transaction has failed; "
            "roll it back (or let the job fail) before opening a checkpoint"
        )
    if schema is None:
        schema = running.schema if running is not None and running.schema else _sql.DEFAULT_SCHEMA
    schema = _sql.validate_schema(schema)
    message_id = running.job.message_id if running is not None and running.conn is conn else None

    with conn.transaction():
        try:
            row = (
                _sql.tuples(conn)
                .execute(
                    _sql.query("checkpoint_lock", schema),
                    {
                        "name": name,
                        "initial_at": initial if kind is dt.datetime else None,
                        "initial_id": initial if kind is int else None,
                        "lag_s": lag_ms / 1000,
                    },
                )
                .fetchone()
            )
        except psycopg.errors.UndefinedTable as error:
            raise SchemaNotReady(
                f"checkpoint table {schema!r}.'checkpoints' does not exist; run 'dramatiq-reliable migrate'"
            ) from error
        assert row is not None  # INSERT ... ON CONFLICT DO UPDATE RETURNING always returns the row
        stored_at, stored_id, clock = row
        if kind is dt.datetime:
            if stored_at is None:
                raise CheckpointError(
                    f"checkpoint {name!r} holds an integer watermark ({stored_id!r}) but initial is a datetime; "
                    "pass an int initial, or use another checkpoint name"
                )
            window: CheckpointWindow[Any] = CheckpointWindow(name, stored_at, max(clock, stored_at))
        else:
            if stored_id is None:
                raise CheckpointError(
                    f"checkpoint {name!r} holds a timestamp watermark ({stored_at!r}) but initial is an int; "
                    "pass an aware datetime initial, or use another checkpoint name"
                )
            window = CheckpointWindow(name, int(stored_id), None)
        yield window
        new = window.watermark
        _sql.tuples(conn).execute(
            _sql.query("checkpoint_advance", schema),
            {
                "name": name,
                "watermark_at": new if kind is dt.datetime else None,
                "watermark_id": new if kind is int else None,
                "message_id": message_id,
            },
        )


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not name.strip() or "\x00" in name or len(name) > _MAX_NAME_CHARS:
        raise CheckpointError(
            f"checkpoint name must be a non-empty string of at most {_MAX_NAME_CHARS} characters without NUL, "
            f"got {name!r}; pass a stable name such as 'orders-sync'"
        )
    return name


def _kind_of(name: str, initial: object) -> type[Any]:
    if isinstance(initial, dt.datetime):
        _check_type(name, initial, dt.datetime, "initial")
        return dt.datetime
    if isinstance(initial, int) and not isinstance(initial, bool):
        _check_type(name, initial, int, "initial")
        return int
    raise CheckpointError(
        f"checkpoint {name!r}: initial must be an aware datetime or an int, got {initial!r}; "
        "pass e.g. initial=datetime(2000, 1, 1, tzinfo=timezone.utc) or initial=0"
    )


def _check_type(name: str, value: object, kind: type[Any], what: str) -> None:
    if kind is dt.datetime:
        if not isinstance(value, dt.datetime):
            raise CheckpointError(
                f"checkpoint {name!r} holds timestamps, but {what} got {value!r}; pass an aware datetime"
            )
        if value.tzinfo is None or value.utcoffset() is None:
            raise CheckpointError(
                f"checkpoint {name!r}: {what} got the naive datetime {value!r}; "
                "pass an aware one, e.g. with tzinfo=timezone.utc"
            )
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise CheckpointError(f"checkpoint {name!r} holds integers, but {what} got {value!r}; pass an int")
    if not _BIGINT[0] <= value <= _BIGINT[1]:
        raise CheckpointError(f"checkpoint {name!r}: {what} got {value!r}, outside bigint; pass a 64-bit int")
