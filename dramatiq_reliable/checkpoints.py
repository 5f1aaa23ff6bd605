"""Checkpoints: the watermark of an incremental job, read and advanced in the job's own transaction.

A job that processes "everything changed since the last successful run" needs to know where the
last successful run stopped.  Kept in a file or a cache, that mark commits apart from the job's
writes: a crash between the two either skips work (mark first) or repeats it without knowing.
Here the mark is a row of ``checkpoints``, locked and updated on the job's transaction, so the
idempotency key, the job's writes and the new watermark commit together or not at all.

A watermark is only as safe as the order in which rows become visible.  Rows do not become
visible in the order of their ids: a sequence hands out ids at INSERT, and a transaction that
took id 1 may commit after the one that took id 2, so a run that saw 2 and recorded it skips 1
for ever.  ``transactions=True`` counts transaction ids instead, and ends every window below the
oldest transaction still running, where nothing can still appear.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

import psycopg
from psycopg.rows import dict_row

from . import _sql
from ._checks import check_bool, check_ms, is_int
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
    clock when the checkpoint's row lock was obtained (minus ``lag_ms``).

    Transaction-id watermarks (``transactions=True``): process rows stamped with a transaction id
    in ``[since, until)``; ``until`` is the oldest transaction still running when the lock was
    obtained, so every row stamped below it is committed (and visible) or never will be.

    Integer watermarks: process ids above ``since`` and report the highest one handled with
    ``advance(to=...)``; ``until`` is ``None`` (the job knows its last id, the database does not).
    Safe only for positions that become visible in order (see :func:`checkpoint`).
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
    transactions: bool = False,
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

    ``transactions=True`` (with an ``int`` initial, usually 0) makes the watermark a transaction
    id: stamp the rows with the id of the transaction that writes them (a ``bigint`` column
    ``DEFAULT txid_current()``) and process ``since <= txid < until``.  ``until`` is the oldest
    transaction still running, so a row committed late is never left behind, however the writers'
    commits interleave; this is the safe integer watermark for a table with concurrent writers.
    Needs schema version 7.  A plain ``int`` watermark (the job reports the last id it handled)
    is safe only when positions become visible in order: one writer, or a cursor of another
    system; a sequence id with concurrent writers skips rows committed out of order.

    >>> @dramatiq.actor(idempotency="transactional")                       # doctest: +SKIP
    ... def sync_orders():
    ...     with checkpoint("orders-sync", initial=EPOCH) as window:
    ...         copy_orders_changed_between(job_connection(), window.since, window.until)
    """
    name = _check_name(name)
    kind = _kind_of(name, initial)
    check_ms("lag_ms", lag_ms, minimum=0, fix="pass e.g. lag_ms=5000")
    check_bool("transactions", transactions)
    if transactions and kind is not int:
        raise CheckpointError(
            f"checkpoint {name!r}: transactions=True counts transaction ids, so initial must be an int, "
            f"got {initial!r}; pass initial=0"
        )
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
        if transactions:
            assert is_int(initial)  # checked above: transactions=True takes an int initial
            window: CheckpointWindow[Any] = _lock_transactions(conn, schema, name, initial)
        else:
            window = _lock(conn, schema, name, initial, kind, lag_ms)
        yield window
        new = window.watermark
        if transactions:
            conn.execute(
                _sql.query("checkpoint_advance_transactions", schema),
                {"name": name, "watermark_txid": new, "message_id": message_id},
            )
        else:
            conn.execute(
                _sql.query("checkpoint_advance", schema),
                {
                    "name": name,
                    "watermark_at": new if kind is dt.datetime else None,
                    "watermark_id": new if kind is int else None,
                    "message_id": message_id,
                },
            )


def _lock(
    conn: psycopg.Connection[Any], schema: str, name: str, initial: Any, kind: type[Any], lag_ms: int
) -> CheckpointWindow[Any]:
    """Lock a timestamp or integer checkpoint and read its window."""
    try:
        row = (
            conn.cursor(row_factory=dict_row)
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
        raise _not_migrated(schema, 5) from error
    assert row is not None  # INSERT ... ON CONFLICT DO UPDATE RETURNING always returns the row
    stored_at, stored_id = row["watermark_at"], row["watermark_id"]
    if stored_at is None and stored_id is None:
        raise _mixed(name, "a transaction-id watermark", "transactions=False", "transactions=True")
    if kind is dt.datetime:
        if stored_at is None:
            raise _mixed(name, f"an integer watermark ({stored_id!r})", "initial is a datetime", "an int initial")
        return CheckpointWindow(name, stored_at, max(row["until"], stored_at))
    if stored_id is None:
        raise _mixed(name, f"a timestamp watermark ({stored_at!r})", "initial is an int", "an aware datetime initial")
    return CheckpointWindow(name, int(stored_id), None)


def _lock_transactions(conn: psycopg.Connection[Any], schema: str, name: str, initial: int) -> CheckpointWindow[int]:
    """Lock a transaction-id checkpoint and read its window, which ends at the oldest running transaction."""
    try:
        row = (
            conn.cursor(row_factory=dict_row)
            .execute(_sql.query("checkpoint_lock_transactions", schema), {"name": name, "initial_txid": initial})
            .fetchone()
        )
    except psycopg.errors.UndefinedTable as error:
        raise _not_migrated(schema, 7) from error
    except psycopg.errors.UndefinedColumn as error:  # a schema from before migration 7
        raise _not_migrated(schema, 7) from error
    assert row is not None
    stored = row["watermark_txid"]
    if stored is None:
        held = (
            f"a timestamp watermark ({row['watermark_at']!r})"
            if row["watermark_at"] is not None
            else f"an integer watermark of ids ({row['watermark_id']!r})"
        )
        raise _mixed(name, held, "transactions=True", "transactions=False")
    since = int(stored)
    # A horizon below ``since`` (an initial ahead of every transaction) is an empty window, never a step back.
    return CheckpointWindow(name, since, max(int(row["horizon"]), since))


def _mixed(name: str, held: str, asked: str, instead: str) -> CheckpointError:
    """A checkpoint continued as another kind: its watermark would mean something else (and skip rows)."""
    return CheckpointError(
        f"checkpoint {name!r} holds {held} but {asked}; pass {instead}, "
        "or use another checkpoint name (its first run starts at initial)"
    )


def _not_migrated(schema: str, version: int) -> SchemaNotReady:
    where = "" if schema == _sql.DEFAULT_SCHEMA else f" --schema {schema}"
    return SchemaNotReady(
        f"checkpoint table {schema!r}.'checkpoints' is missing or older than schema version {version}; "
        f"run 'dramatiq-reliable migrate{where}'"
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
    if is_int(initial):
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
    if not is_int(value):
        raise CheckpointError(f"checkpoint {name!r} holds integers, but {what} got {value!r}; pass an int")
    if not _BIGINT[0] <= value <= _BIGINT[1]:
        raise CheckpointError(f"checkpoint {name!r}: {what} got {value!r}, outside bigint; pass a 64-bit int")
