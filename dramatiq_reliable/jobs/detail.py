"""One job as a page shows it: :func:`show_job`'s answer plus what the page links to, in one snapshot.

``jobs show`` prints a :class:`~dramatiq_reliable.jobs.JobStatus`; a page also wants the
structured cancellation (who and when, not only the sentence in ``detail``) and the id of the
dead letter to link to.  Read apart, a job cancelled or dead-lettered between two reads would
show a state and a record that disagree, so :func:`job_detail` reads all three in the one
repeatable-read snapshot ``show_job`` uses when handed a connection inside a transaction.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg.rows import dict_row

from .. import _sql
from ..database import Database
from .cancel import CancelRecord, get_cancellation
from .lookup import JobStatus, show_job

# Internal: the web page's; the public way to look a job up is show_job().
__all__: list[str] = []


@dataclasses.dataclass(frozen=True)
class JobDetail:
    """A job's status, its cancellation (``state == "cancelled"``) and its dead letter (``state == "dead"``)."""

    status: JobStatus
    cancellation: CancelRecord | None
    dead_letter_id: int | None


@contextlib.contextmanager
def _snapshot(conn: psycopg.Connection[Any], schema: str) -> Iterator[None]:
    """One snapshot for every read of the page.  A connection already in a transaction that has
    read nothing yet (the web page's read pool behind a transaction pooler begins each borrow
    with ``SET LOCAL statement_timeout``) takes it there: a savepoint could not set it."""
    if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        conn.execute(_sql.query("jobs_snapshot", schema))
        yield
        return
    with conn.transaction():
        conn.execute(_sql.query("jobs_snapshot", schema))
        yield


def job_detail(database: Database, schema: str, id: str) -> JobDetail:
    """:func:`show_job` of ``id`` (a message id or an idempotency key), with its cancellation and dead letter.

    Raises what ``show_job`` raises: :class:`~dramatiq_reliable.errors.JobNotFound` for an id no
    table knows, ``SchemaNotReady`` before the jobs migration.  Reads only.
    """
    schema = _sql.validate_schema(schema)
    with database.autocommit() as conn, _snapshot(conn, schema):
        status = show_job(conn, schema, id)
        cancellation = get_cancellation(conn, schema, status.message_id) if status.state == "cancelled" else None
        dead_letter_id = _dead_letter_id(conn, schema, status.message_id) if status.state == "dead" else None
    return JobDetail(status=status, cancellation=cancellation, dead_letter_id=dead_letter_id)


def _dead_letter_id(conn: psycopg.Connection[Any], schema: str, message_id: str) -> int | None:
    cursor = conn.cursor(row_factory=dict_row)
    row = cursor.execute(_sql.query("jobs_dead_letter_id", schema), {"message_id": message_id}).fetchone()
    return int(row["id"]) if row is not None else None
