"""A workflow by id: its state and each step's, read in the library, the CLI and the page; and its cancel."""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

import psycopg
from psycopg.rows import dict_row

from .. import _sql
from .._checks import check_choice, check_int, check_text
from ..database import Database, DatabaseLike
from ..errors import DatabaseUnavailable, JobNotFound
from ..jobs.cancel import CancelResult, cancel_in_transaction
from ..schema import WORKFLOW_VERSION, current_version, ensure_ready

__all__ = [
    "StepOf",
    "WorkflowCancel",
    "WorkflowStatus",
    "WorkflowStep",
    "WorkflowSummary",
    "cancel_workflow",
    "list_workflows",
    "step_of",
    "workflow_status",
]


@dataclasses.dataclass(frozen=True)
class WorkflowStep:
    """One step: where it sits (stage, position in its group), its message and its state."""

    stage: int
    position: int
    #: whether its stage is a group (its result joins a list) or a single step
    in_group: bool
    message_id: str
    actor_name: str
    queue_name: str
    #: ``waiting`` (a later stage), ``sent``, ``done``, ``dead`` or ``cancelled``
    state: str
    #: what it returned (JSON), ``None`` until done
    result: Any
    sent_at: datetime.datetime | None
    finished_at: datetime.datetime | None


@dataclasses.dataclass(frozen=True)
class WorkflowStatus:
    """One workflow: its state, the stage running now and every step in order."""

    id: str
    #: ``running``, ``succeeded``, ``failed`` or ``cancelled``
    state: str
    if_step_dies: str
    stage: int
    stages: int
    #: why it failed, or the reason given when it was cancelled
    error: str | None
    cancelled_by: str | None
    created_at: datetime.datetime
    finished_at: datetime.datetime | None
    steps: tuple[WorkflowStep, ...]

    @property
    def waiting_for_replay(self) -> bool:
        """Whether it is held by a dead step under ``if_step_dies="wait"`` (replay its dead letter)."""
        return self.state == "running" and self.if_step_dies == "wait" and any(s.state == "dead" for s in self.steps)

    def asdict(self) -> dict[str, Any]:
        """JSON-ready: timestamps as ISO 8601 strings."""

        def plain(value: Any) -> Any:
            return value.isoformat() if isinstance(value, datetime.datetime) else value

        out: dict[str, Any] = {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}
        out["waiting_for_replay"] = self.waiting_for_replay
        out["steps"] = [{k: plain(v) for k, v in dataclasses.asdict(step).items()} for step in self.steps]
        return out


#: The states a workflow can be in, and what ``list_workflows(state=...)`` takes.
STATES = ("running", "succeeded", "failed", "cancelled")


@dataclasses.dataclass(frozen=True)
class WorkflowSummary:
    """One row of :func:`list_workflows`: a workflow without its steps."""

    id: str
    state: str
    if_step_dies: str
    stage: int
    stages: int
    error: str | None
    created_at: datetime.datetime
    finished_at: datetime.datetime | None

    def asdict(self) -> dict[str, Any]:
        """JSON-ready: timestamps as ISO 8601 strings."""
        return {
            f.name: (v.isoformat() if isinstance(v := getattr(self, f.name), datetime.datetime) else v)
            for f in dataclasses.fields(self)
        }


@dataclasses.dataclass(frozen=True)
class StepOf:
    """Where a job sits in a workflow, for ``jobs show``: the workflow, the step's place and both states."""

    workflow_id: str
    stage: int
    position: int
    step_state: str
    workflow_state: str
    stages: int

    def asdict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class WorkflowCancel:
    """What :func:`cancel_workflow` did: ``changed`` only when this call cancelled it."""

    id: str
    changed: bool
    #: the workflow's state after the call (``cancelled``, or the state it had finished in)
    state: str
    #: how many steps were never sent (later stages)
    never_sent: int
    #: the job cancel of each step that was sent and had not finished
    jobs: tuple[CancelResult, ...]

    def asdict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "changed": self.changed,
            "state": self.state,
            "never_sent": self.never_sent,
            "jobs": [job.as_dict() for job in self.jobs],
        }


def _with_conn(database: DatabaseLike | psycopg.Connection[Any], schema: str, read: Any) -> Any:
    if isinstance(database, psycopg.Connection):
        ensure_ready(database, schema=schema, required=WORKFLOW_VERSION, feature="workflows")
        return read(database)
    db = Database.of(database, max_size=1)
    try:
        with db.connection() as conn, conn.transaction():
            ensure_ready(conn, schema=schema, required=WORKFLOW_VERSION, feature="workflows")
            return read(conn)
    finally:
        if db is not database:
            db.close()


def _check_id(id: object) -> str:
    if not isinstance(id, str) or not id or "\x00" in id:
        raise JobNotFound(f"workflow id {id!r} is not a workflow id; pass Workflow(...).id")
    return id


def _not_found(id: str, schema: str) -> JobNotFound:
    return JobNotFound(
        f"no workflow {id!r} in schema {schema!r}; check the id (Workflow.id), and that the transaction that ran it "
        "committed"
    )


def workflow_status(
    database: DatabaseLike | psycopg.Connection[Any], schema: str = _sql.DEFAULT_SCHEMA, id: str = ""
) -> WorkflowStatus:
    """Workflow ``id`` and its steps; raises :class:`~dramatiq_reliable.errors.JobNotFound` for an unknown id.

    Two indexed reads in one snapshot (the workflow's row, then its steps), so the steps agree
    with the state.  ``database`` is a URL, a pool, a ``Database`` or an open connection.

    >>> workflow_status(broker.database, broker.schema, workflow.id).state   # doctest: +SKIP
    'succeeded'
    """
    schema = _sql.validate_schema(schema)
    id = _check_id(id)

    def read(conn: psycopg.Connection[Any]) -> WorkflowStatus:
        cur = conn.cursor(row_factory=dict_row)
        row = cur.execute(_sql.query("workflow_get", schema), {"id": id}).fetchone()
        if row is None:
            raise _not_found(id, schema)
        steps = cur.execute(_sql.query("workflow_steps", schema), {"id": id}).fetchall()
        return WorkflowStatus(
            id=row["id"],
            state=row["state"],
            if_step_dies=row["if_step_dies"],
            stage=row["stage"],
            stages=row["stages"],
            error=row["error"],
            cancelled_by=row["cancelled_by"],
            created_at=row["created_at"],
            finished_at=row["finished_at"],
            steps=tuple(
                WorkflowStep(
                    stage=s["stage"],
                    position=s["position"],
                    in_group=s["is_group"],
                    message_id=s["message_id"],
                    actor_name=s["actor_name"],
                    queue_name=s["queue_name"],
                    state=s["state"],
                    result=s["result"],
                    sent_at=s["sent_at"],
                    finished_at=s["finished_at"],
                )
                for s in steps
            ),
        )

    result: WorkflowStatus = _with_conn(database, schema, read)
    return result


def cancel_workflow(
    database: DatabaseLike, schema: str = _sql.DEFAULT_SCHEMA, id: str = "", *, by: str, reason: str | None = None
) -> WorkflowCancel:
    """Stop workflow ``id``: no later stage is sent, and each sent step is cancelled as a job.

    One transaction: the workflow's row is marked ``cancelled`` under its lock (a step finishing
    its stage at the same moment waits for it, then sends nothing; one that finished first had
    sent its stage, whose steps are then cancelled here), the unsent steps are marked, and each
    sent, unfinished step goes through the job cancel (deleted from the outbox or queue, or
    tombstoned for the ``Cancellation`` middleware).  A workflow already over changes nothing.
    Raises ``JobNotFound`` for an unknown id.
    """
    schema = _sql.validate_schema(schema)
    id = _check_id(id)
    check_text("by", by, max_chars=200, fix="pass who cancels, e.g. a user name")
    check_text("reason", reason, max_chars=2000, allow_none=True, fix="pass a short reason or None")

    def cancel(conn: psycopg.Connection[Any]) -> WorkflowCancel:
        cur = conn.cursor(row_factory=dict_row)
        row = cur.execute(_sql.query("workflow_cancel", schema), {"id": id, "by": by, "reason": reason}).fetchone()
        if row is None:
            found = cur.execute(_sql.query("workflow_get", schema), {"id": id}).fetchone()
            if found is None:
                raise _not_found(id, schema)
            return WorkflowCancel(id=id, changed=False, state=found["state"], never_sent=0, jobs=())
        sent = cur.execute(_sql.query("workflow_cancel_sent", schema), {"id": id}).fetchall()
        jobs = tuple(cancel_in_transaction(conn, schema, s["message_id"], by=by, reason=reason) for s in sent)
        return WorkflowCancel(id=id, changed=True, state="cancelled", never_sent=int(row["never_sent"]), jobs=jobs)

    try:
        result: WorkflowCancel = _with_conn(database, schema, cancel)
    except psycopg.OperationalError as error:
        raise DatabaseUnavailable(
            f"could not cancel workflow {id!r}: Postgres is unreachable ({error}); nothing changed, try again"
        ) from error
    return result


def step_of(conn: psycopg.Connection[Any], schema: str, message_id: str) -> StepOf | None:
    """The workflow whose step ``message_id`` is, or ``None`` (not a step, or a schema before workflows).

    One indexed read on the caller's connection and transaction; never raises for a schema that
    has no workflow tables yet, so ``jobs show`` works on every version.
    """
    version = current_version(conn, schema=schema)
    if version is None or version < WORKFLOW_VERSION:
        return None
    row = (
        conn.cursor(row_factory=dict_row)
        .execute(_sql.query("workflow_of_step", schema), {"message_id": message_id})
        .fetchone()
    )
    if row is None:
        return None
    return StepOf(
        workflow_id=row["workflow_id"],
        stage=row["stage"],
        position=row["position"],
        step_state=row["step_state"],
        workflow_state=row["state"],
        stages=row["stages"],
    )


def list_workflows(
    database: DatabaseLike | psycopg.Connection[Any],
    schema: str = _sql.DEFAULT_SCHEMA,
    *,
    state: str | None = None,
    limit: int = 50,
) -> list[WorkflowSummary]:
    """The newest workflows first (in ``state`` if given), without their steps: the page's list.

    One read by the ``created_at`` index; open one with :func:`workflow_status`.
    """
    schema = _sql.validate_schema(schema)
    if state is not None:
        check_choice("state", state, STATES)
    check_int("limit", limit, minimum=1, maximum=10_000, fix="e.g. limit=50")

    def read(conn: psycopg.Connection[Any]) -> list[WorkflowSummary]:
        rows = (
            conn.cursor(row_factory=dict_row)
            .execute(_sql.query("workflow_list", schema), {"state": state, "limit": limit})
            .fetchall()
        )
        return [WorkflowSummary(**row) for row in rows]

    result: list[WorkflowSummary] = _with_conn(database, schema, read)
    return result
