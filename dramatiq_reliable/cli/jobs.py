"""``dramatiq-reliable jobs``: look a job up by message id or idempotency key, list jobs by state, cancel one.

::

    dramatiq-reliable jobs show ID [--json]
    dramatiq-reliable jobs list --state retrying|dead|waiting [--actor A] [--queue Q] [--limit N] [--json]
    dramatiq-reliable jobs cancel ID [--reason TEXT] [--by NAME] [--yes] [--json]

``jobs show ID`` exits ``NOT_FOUND`` (7) for an id no table knows.  ``cancel`` asks for
confirmation on a terminal; ``--yes`` skips it, and without a terminal and without ``--yes`` it
is refused (exit ``ABORTED``).  Its exit codes: ``OK`` when the job is cancelled now or was
already, ``NOT_FOUND`` (7) when Postgres holds nothing of that id, and ``REFUSED`` (8) when the
job already finished (done or dead) and so was left alone.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import psycopg

from ..database import Database
from ..dead_letters.validators import check_by
from ..jobs.cancel import ALREADY_CANCELLED, FINISHED, UNKNOWN, CancelResult, cancel_job
from ..jobs.lookup import LISTABLE_STATES, JobStatus, list_jobs, show_job
from ..workflows.state import StepOf, step_of
from . import output
from .common import (
    ExitCode,
    Integer,
    add_action,
    add_cancel,
    add_command,
    add_json,
    add_show,
    cancel_one,
    connect,
    print_error,
    show_one,
)

__all__ = ["register"]


def register(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    parents: Sequence[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add ``jobs show``, ``jobs list`` and ``jobs cancel``; ``parents`` supply ``--database-url`` and ``--schema``."""
    parser, actions = add_command(
        subparsers,
        "jobs",
        help="look jobs up by id, list them by state, cancel one",
        description="What became of a job: waiting, scheduled, published, retrying, running, done, dead.",
    )
    add_show(
        actions,
        parents,
        _show,
        help="the state of one job",
        description="The state of one job, its attempts, last error, next try and trace id (exit 7: unknown id).",
        id_help="a message id, or an idempotency key",
    )

    listing = add_action(
        actions,
        "list",
        parents,
        _list,
        help="jobs retrying, dead or waiting",
        description="Jobs in one state: retrying (latest failure first), dead (latest first), waiting (oldest first).",
    )
    listing.add_argument("--state", choices=LISTABLE_STATES, required=True, help="which jobs")
    listing.add_argument("--actor", help="only this actor")
    listing.add_argument("--queue", help="only this queue")
    listing.add_argument(
        "--limit",
        type=Integer(minimum=1, maximum=10_000),
        default=50,
        metavar="N",
        help="at most N jobs (default %(default)s)",
    )
    add_json(listing)

    add_cancel(
        actions,
        parents,
        _cancel,
        help="cancel a job: removed if it still waits in Postgres, else skipped on delivery or stopped",
        description=(
            "Cancel the job with this message id.  Still in the outbox or the Postgres queue table: its row is "
            "deleted.  Already in RabbitMQ, held or running: a tombstone makes workers skip it on delivery, and a "
            "running job stops at its next is_cancelled() check (needs the Cancellation middleware).  A job that "
            "already finished is left alone (exit 8); an unknown id changes nothing (exit 7)."
        ),
        id_help="the job's Dramatiq message id",
        reason_help="why, kept with the cancellation for 'jobs show'",
        id_metavar="ID",
    )
    return parser


def _show(args: argparse.Namespace) -> int:
    def look_up(conn: psycopg.Connection[Any]) -> tuple[JobStatus, StepOf | None]:
        status = show_job(conn, args.schema, args.id)
        return status, step_of(conn, args.schema, status.message_id)

    return show_one(
        args,
        look_up,
        as_dict=lambda found: {**found[0].asdict(), "workflow": None if found[1] is None else found[1].asdict()},
        describe=lambda found: _describe(*found),
    )


def _describe(status: JobStatus, step: StepOf | None = None) -> str:
    lines = [("message", status.message_id), ("state", status.state)]
    if status.since is not None:
        lines.append(("since", f"{status.since.isoformat()} ({output.ago(status.since)})"))
    lines.append(("actor", status.actor_name or "-"))
    lines.append(("queue", status.queue_name or "-"))
    if status.attempts:
        limit = "no limit" if status.max_retries is None else f"max retries {status.max_retries}"
        lines.append(("attempts", f"{status.attempts} failed ({limit})"))
    if status.last_error_type or status.last_error_message:
        lines.append(("last error", f"{status.last_error_type or '?'}: {status.last_error_message or ''}"))
    if status.last_error_where:
        lines.append(("where", status.last_error_where))
    if status.next_due_at is not None:
        lines.append(("next try", status.next_due_at.isoformat()))
    if status.where:
        lines.append(("held by", status.where))
    if status.trace_id:
        lines.append(("trace id", status.trace_id))
    lines.append(("detail", status.detail))
    if step is not None:
        lines.append(
            (
                "workflow",
                f"{step.workflow_id} ({step.workflow_state}): stage {step.stage + 1} of {step.stages}, step "
                f"{step.position + 1}, {step.step_state}; 'dramatiq-reliable workflows show' lists every step",
            )
        )
    return output.labelled(lines)


def _list(args: argparse.Namespace) -> int:
    with connect(args, autocommit=True) as conn:
        rows = list_jobs(conn, args.schema, state=args.state, actor=args.actor, queue=args.queue, limit=args.limit)
    output.print_rows(
        rows,
        as_json=args.json,
        empty=f"no {args.state} jobs",
        headers=["MESSAGE", "ACTOR", "QUEUE", "ATTEMPTS", "SINCE", "ERROR"],
        cells=lambda row: [
            row.message_id,
            row.actor_name,
            row.queue_name,
            str(row.attempts),
            output.ago(row.since),
            f"{row.error_type}: {row.error_message}" if row.error_type else row.error_message,
        ],
        right=(3,),
    )
    return ExitCode.OK


def _cancel(args: argparse.Namespace) -> int:
    def report(result: CancelResult) -> None:
        if result.outcome == UNKNOWN:
            print_error(
                f"no job with message id {args.id!r} in schema {args.schema!r} (not in the outbox, the queue table, "
                "the processed keys or the dead letters); nothing changed"
            )
        else:
            print(f"job {args.id}: {result.describe()}")

    def exit_code(result: CancelResult) -> int:
        if result.outcome == UNKNOWN:
            return ExitCode.NOT_FOUND
        if result.outcome == FINISHED:
            return ExitCode.REFUSED
        assert result.changed or result.outcome == ALREADY_CANCELLED
        return ExitCode.OK

    def cancel(database: Database) -> CancelResult:
        return cancel_job(database, args.schema, args.id, by=check_by(args.by), reason=args.reason)

    return cancel_one(args, "job", cancel, as_dict=CancelResult.as_dict, report=report, exit_code=exit_code)
