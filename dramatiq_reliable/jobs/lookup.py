"""Look a job up by id: what Postgres knows of one message, said as one state.

:func:`show_job` answers "what became of message X" (or of idempotency key X) from the rows the
package already keeps, plus the failure record :mod:`~dramatiq_reliable.jobs.attempts` writes:

============================ =================================================================
state                        from
============================ =================================================================
``cancelled``                a cancellation (``jobs cancel``), unless the job committed first
``dead``                     a dead letter in state ``dead``
``done``                     the processed-job key (``Idempotency``): the job committed
``running``                  a ``LongJobs`` lease, or a leased ``PostgresBroker`` queue row
``retrying``                 a failure record whose last decision was a retry
``scheduled``                an outbox or queue row that is not due yet
``waiting``                  an unpublished outbox row, a queue row no worker holds, or a job
                             parked until its turn in its order key (``OrderedKeys``)
``published_no_news``        an outbox row the relay published, and nothing since
============================ =================================================================

The first reader that recognises the message wins, in that order.  "published, no news" is
said as it is: RabbitMQ holds the message (queued, or in a worker) and Postgres learns of it
again only when it fails, finishes under ``Idempotency`` or dies.

Each reader is a small function over one table; :data:`STATE_READERS` is the ordered list, so a
new state is one more reader in its place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
from collections.abc import Callable, Iterator
from typing import Any, Literal

import psycopg
from psycopg.rows import dict_row

from .. import _sql
from .._checks import check_choice, check_int
from ..database import Database, DatabaseLike
from ..errors import JobNotFound
from ..schema import JOBS_VERSION, ensure_ready, table_exists
from .attempts import trace_id_of
from .cancel import get_cancellation

__all__ = [
    "JOB_STATES",
    "LISTABLE_STATES",
    "STATE_READERS",
    "Finding",
    "JobListing",
    "JobState",
    "JobStatus",
    "list_jobs",
    "show_job",
]

JobState = Literal["waiting", "scheduled", "published_no_news", "retrying", "running", "done", "dead", "cancelled"]
JOB_STATES: tuple[JobState, ...] = (
    "waiting",
    "scheduled",
    "published_no_news",
    "retrying",
    "running",
    "done",
    "dead",
    "cancelled",
)
ListableState = Literal["retrying", "dead", "waiting"]
LISTABLE_STATES: tuple[ListableState, ...] = ("retrying", "dead", "waiting")


def _jsonable(record: Any) -> dict[str, Any]:
    return {
        key: value.isoformat() if isinstance(value, datetime.datetime) else value
        for key, value in dataclasses.asdict(record).items()
    }


@dataclasses.dataclass(frozen=True)
class JobStatus:
    """What is known of one message.  ``since`` is when it entered ``state``.

    ``attempts`` counts failed attempts (0: none recorded); ``last_error_*`` and ``next_due_at``
    come from the failure record (or the dead letter); ``where`` says who holds it (a worker's
    lease owner) or which queue it waits in.
    """

    message_id: str
    state: JobState
    since: datetime.datetime | None
    actor_name: str | None
    queue_name: str | None
    attempts: int
    max_retries: int | None
    last_error_type: str | None
    last_error_message: str | None
    last_error_where: str | None
    next_due_at: datetime.datetime | None
    trace_id: str | None
    where: str | None
    detail: str

    def asdict(self) -> dict[str, Any]:
        """JSON-able: datetimes as ISO 8601."""
        return _jsonable(self)


@dataclasses.dataclass(frozen=True)
class Finding:
    """What one reader recognised: the state and what only its table knows."""

    state: JobState
    since: datetime.datetime | None
    detail: str
    actor_name: str | None = None
    queue_name: str | None = None
    where: str | None = None
    error_type: str | None = None
    error_message: str | None = None
    error_where: str | None = None
    attempts: int | None = None
    trace_id: str | None = None


@dataclasses.dataclass(frozen=True)
class Lookup:
    """What a reader is given: the connection, the schema, the message id and its failure record.

    ``key_row`` is the processed-job row the id was found under, when it was an idempotency key.
    """

    conn: psycopg.Connection[Any]
    schema: str
    message_id: str
    attempts: dict[str, Any] | None
    key_row: dict[str, Any] | None = None


#: A reader recognises the message in its table, or returns ``None``.
Reader = Callable[[Lookup], Finding | None]


def _one(lookup: Lookup, name: str) -> dict[str, Any] | None:
    if name == "jobs_outbox" and table_exists(lookup.conn, lookup.schema, "outbox_published"):
        # Published rows may have moved to the partitioned history (dramatiq_reliable.partitions).
        name = "jobs_outbox_history"
    cursor = lookup.conn.cursor(row_factory=dict_row)
    row: dict[str, Any] | None = cursor.execute(
        _sql.query(name, lookup.schema), {"message_id": lookup.message_id}
    ).fetchone()
    return row


def read_dead(lookup: Lookup) -> Finding | None:
    """A dead letter not yet replayed or discarded."""
    row = _one(lookup, "jobs_dead")
    if row is None:
        return None
    return Finding(
        "dead",
        row["last_failed_at"],
        f"dead letter ({row['reason']}); replay it with 'dramatiq-reliable dead-letters replay'",
        actor_name=row["actor_name"],
        queue_name=row["queue_name"],
        error_type=row["error_type"],
        error_message=row["error_message"],
        error_where=row["culprit"],
        attempts=row["attempts"],
        trace_id=trace_id_of({"trace_context": {"traceparent": row["traceparent"]}}),
    )


def read_done(lookup: Lookup) -> Finding | None:
    """A processed-job key under the message id: the job ran and its transaction committed."""
    row = lookup.key_row or _one(lookup, "jobs_processed")
    if row is None:
        return None
    return Finding("done", row["created_at"], "finished (its idempotency key is stored)", actor_name=row["actor_name"])


def read_running(lookup: Lookup) -> Finding | None:
    """A live LongJobs lease, or a PostgresBroker queue row a worker holds."""
    lease = _one(lookup, "jobs_lease")
    if lease is not None:
        return Finding(
            "running",
            lease["started_at"],
            f"running (long job), lease until {lease['expires_at'].isoformat()}",
            actor_name=lease["actor_name"],
            queue_name=lease["queue_name"],
            where=lease["owner"],
        )
    row = _one(lookup, "jobs_queue")
    if row is not None and row["lease"] is not None:
        return Finding(
            "running",
            None,
            f"held by a PostgresBroker worker (delivery {row['deliveries']})",
            actor_name=row["actor_name"],
            queue_name=row["queue_name"],
        )
    return None


def read_retrying(lookup: Lookup) -> Finding | None:
    """A failure record whose latest decision was to retry."""
    record = lookup.attempts
    if record is None or record["outcome"] != "retry":
        return None
    return Finding("retrying", record["failed_at"], "failed; its retry is scheduled")


def read_queued(lookup: Lookup) -> Finding | None:
    """An outbox row not yet published, or a queue-table row waiting for a worker."""
    row = _one(lookup, "jobs_outbox")
    if row is not None and row["published_at"] is None:
        state: JobState = "scheduled" if row["later"] else "waiting"
        detail = f"in the outbox, {row['attempts']} publish attempt(s)"
        if row["last_error"]:
            detail += f", last publish error: {row['last_error']}"
        since = row["available_at"] if state == "scheduled" else row["created_at"]
        return Finding(state, since, detail, actor_name=row["actor_name"], queue_name=row["queue_name"])
    queued = _one(lookup, "jobs_queue")
    if queued is not None and queued["lease"] is None:
        state = "scheduled" if queued["later"] else "waiting"
        since = queued["available_at"] if state == "scheduled" else queued["enqueued_at"]
        return Finding(
            state,
            since,
            f"in the Postgres queue table, {queued['deliveries']} earlier deliveries",
            actor_name=queued["actor_name"],
            queue_name=queued["queue_name"],
        )
    return None


def read_ordered(lookup: Lookup) -> Finding | None:
    """A job parked in Postgres until its turn in its ``order_key``: in neither the outbox nor the
    queue (``OrderedKeys`` parks a job sent behind its key's head at send)."""
    if not table_exists(lookup.conn, lookup.schema, "order_jobs"):
        return None
    row = _one(lookup, "jobs_order")
    if row is None:
        return None
    head = f"its head {row['head_message_id']} is {row['head_state']}"
    if row["head_state"] == "dead":
        head += " (replay or discard that dead letter to free the key)"
    return Finding(
        "waiting",
        row["sent_at"],
        f"parked in Postgres until its turn in order key {row['key']!r}: {row['ahead']} job(s) ahead; {head}",
        actor_name=row["actor_name"],
        queue_name=row["queue_name"],
    )


def read_gave_up(lookup: Lookup) -> Finding | None:
    """A failure record whose last decision was to give up, with no dead letter and nothing sent since.

    Without ``DeadLetters`` no dead letter is stored; a replayed or discarded one is no longer
    ``dead``.  A row sent after the last failure (a replay) is newer news, told by the next reader.
    """
    record = lookup.attempts
    if record is None or record["outcome"] == "retry":
        return None
    row = _one(lookup, "jobs_outbox")
    if row is not None and row["created_at"] > record["failed_at"]:
        return None
    return Finding(
        "dead",
        record["failed_at"],
        f"gave up ({record['outcome']}: {record['reason']}); no dead letter is stored for it "
        "(DeadLetters not installed, or it was replayed or discarded)",
    )


def read_published(lookup: Lookup) -> Finding | None:
    """An outbox row the relay published: RabbitMQ has it, Postgres has heard nothing since."""
    row = _one(lookup, "jobs_outbox")
    if row is None or row["published_at"] is None:
        return None
    return Finding(
        "published_no_news",
        row["published_at"],
        "published to RabbitMQ; no news since (it waits in the queue or runs; Postgres hears again "
        "when it fails, finishes under Idempotency, or dies)",
        actor_name=row["actor_name"],
        queue_name=row["queue_name"],
    )


def read_cancelled(lookup: Lookup) -> Finding | None:
    """A cancellation (``jobs cancel``): its row was removed, or a tombstone stops it on delivery or at a check.

    Asked after ``done``: a job that committed before it saw its tombstone did run, and says so.
    """
    record = get_cancellation(lookup.conn, lookup.schema, lookup.message_id)
    if record is None:
        return None
    where = {
        "outbox": "its outbox row was removed before it was published",
        "queue": "its queue row was removed before a worker took it",
    }.get(record.found_in, "a tombstone makes workers skip it on delivery and stops it at its next check")
    honoured = f"; {record.honoured_how} at {record.honoured_at.isoformat()}" if record.honoured_at else ""
    reason = f" ({record.reason})" if record.reason else ""
    return Finding(
        "cancelled",
        record.cancelled_at,
        f"cancelled by {record.cancelled_by}{reason}: {where}{honoured}",
        where=record.found_in,
    )


#: The readers, in the order they are asked; the first that recognises the message decides its state.
STATE_READERS: list[Reader] = [
    read_dead,
    read_done,
    read_cancelled,
    read_running,
    read_retrying,
    read_queued,
    read_ordered,
    read_gave_up,
    read_published,
]


def _candidates(conn: psycopg.Connection[Any], schema: str, id: str) -> list[tuple[str, dict[str, Any] | None]]:
    """``id`` as a message id, then the message ids stored under ``id`` as an idempotency key (with their row)."""
    rows = conn.cursor(row_factory=dict_row).execute(_sql.query("jobs_by_key", schema), {"id": id}).fetchall()
    return [(id, None), *((row["message_id"], row) for row in rows if row["message_id"] != id)]


@contextlib.contextmanager
def _connected(database: DatabaseLike | psycopg.Connection[Any]) -> Iterator[psycopg.Connection[Any]]:
    if isinstance(database, psycopg.Connection):
        yield database
        return
    owned = not isinstance(database, Database)
    db = Database.of(database, max_size=1)
    try:
        with db.autocommit() as conn:
            yield conn
    finally:
        if owned:
            db.close()


def show_job(
    database: DatabaseLike | psycopg.Connection[Any], schema: str = _sql.DEFAULT_SCHEMA, id: str = ""
) -> JobStatus:
    """The state of the message with id ``id`` (or stored under idempotency key ``id``).

    ``database`` is a URL, a pool, a ``Database`` or an open connection.  Raises
    :class:`~dramatiq_reliable.errors.JobNotFound` when no table knows the id: never sent from
    here, or purged by retention.  Reads only; each reader is one indexed lookup.

    >>> show_job(broker.database, broker.schema, message.message_id).state   # doctest: +SKIP
    'retrying'
    """
    schema = _sql.validate_schema(schema)
    if not isinstance(id, str) or not id or "\x00" in id:
        raise JobNotFound(f"job id {id!r} is not a message id or an idempotency key; pass a non-empty string")
    with _connected(database) as conn:
        if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            return _show(conn, schema, id)  # the caller's transaction, and its snapshot
        # One snapshot for every reader: read one by one, a message a worker claims between two
        # reads would be seen by neither (queued for the first, gone for the second).
        with conn.transaction():
            conn.execute(_sql.query("jobs_snapshot", schema))
            return _show(conn, schema, id)


def _show(conn: psycopg.Connection[Any], schema: str, id: str) -> JobStatus:
    ensure_ready(conn, schema=schema, required=JOBS_VERSION, feature="jobs")
    for message_id, key_row in _candidates(conn, schema, id):
        cursor = conn.cursor(row_factory=dict_row)
        record = cursor.execute(_sql.query("jobs_attempts", schema), {"message_id": message_id}).fetchone()
        lookup = Lookup(conn, schema, message_id, record, key_row)
        for reader in STATE_READERS:
            finding = reader(lookup)
            if finding is not None:
                return _status(message_id, finding, record)
        if record is not None:
            # Retention took every other row: the failure record is all that is left.
            return _status(
                message_id, Finding("dead", record["failed_at"], f"last failed ({record['outcome']})"), record
            )
    raise JobNotFound(
        f"no job {id!r} in schema {schema!r}: no outbox, queue, failure, dead-letter or idempotency row has that "
        "message id or key; check the id (message ids are UUIDs), or it was purged by retention"
    )


def _status(message_id: str, finding: Finding, record: dict[str, Any] | None) -> JobStatus:
    rec = record or {}
    return JobStatus(
        message_id=message_id,
        state=finding.state,
        since=finding.since,
        actor_name=finding.actor_name or rec.get("actor_name"),
        queue_name=finding.queue_name or rec.get("queue_name"),
        attempts=finding.attempts if finding.attempts is not None else int(rec.get("attempts") or 0),
        max_retries=rec.get("max_retries"),
        last_error_type=finding.error_type or rec.get("error_type"),
        last_error_message=finding.error_message or rec.get("error_message"),
        last_error_where=finding.error_where or rec.get("error_where"),
        next_due_at=rec.get("next_due_at") if finding.state == "retrying" else None,
        trace_id=finding.trace_id or rec.get("trace_id"),
        where=finding.where,
        detail=finding.detail,
    )


@dataclasses.dataclass(frozen=True)
class JobListing:
    """One row of :func:`list_jobs`."""

    message_id: str
    state: ListableState
    actor_name: str
    queue_name: str
    attempts: int
    max_retries: int | None
    error_type: str | None
    error_message: str
    since: datetime.datetime
    next_due_at: datetime.datetime | None

    def asdict(self) -> dict[str, Any]:
        """JSON-able: datetimes as ISO 8601."""
        return _jsonable(self)


def list_jobs(
    database: DatabaseLike | psycopg.Connection[Any],
    schema: str = _sql.DEFAULT_SCHEMA,
    *,
    state: ListableState,
    actor: str | None = None,
    queue: str | None = None,
    limit: int = 50,
) -> list[JobListing]:
    """The jobs in ``state`` (retrying, dead or waiting), newest failure first (oldest waiting first)."""
    schema = _sql.validate_schema(schema)
    check_choice("state", state, LISTABLE_STATES)
    check_int("limit", limit, minimum=1, maximum=10_000, fix="e.g. limit=50")
    with _connected(database) as conn:
        ensure_ready(conn, schema=schema, required=JOBS_VERSION, feature="jobs")
        cursor = conn.cursor(row_factory=dict_row)
        rows = cursor.execute(
            _sql.query(f"jobs_list_{state}", schema), {"actor": actor, "queue": queue, "limit": limit}
        ).fetchall()
    listed = [
        JobListing(
            message_id=row["message_id"],
            state=state,
            actor_name=row["actor_name"],
            queue_name=row["queue_name"],
            attempts=int(row["attempts"] or 0),
            max_retries=row["max_retries"],
            error_type=row["error_type"],
            error_message=row["error_message"] or "",
            since=row["since"],
            next_due_at=row["next_due_at"],
        )
        for row in rows
    ]
    return listed[:limit]
