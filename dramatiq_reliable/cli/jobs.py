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

from ..dead_letters.validators import check_by
from ..errors import JobNotFound
from ..jobs.cancel import ALREADY_CANCELLED, FINISHED, UNKNOWN, cancel_job
from ..jobs.lookup import LISTABLE_STATES, JobStatus, list_jobs, show_job
from ..workflows.state import StepOf, step_of
from . import output
from .common import ExitCode, Integer, confirm, connect, open_database, print_error

__all__ = ["register"]


def register(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    parents: Sequence[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add ``jobs show``, ``jobs list`` and ``jobs cancel``; ``parents`` supply ``--database-url`` and ``--schema``."""
    parser = subparsers.add_parser(
        "jobs",
        help="look jobs up by id, list them by state, cancel one",
        description="What became of a job: waiting, scheduled, published, retrying, running, done, dead.",
    )
    actions = parser.add_subparsers(dest="jobs_command", required=True, metavar="ACTION")
    show = actions.add_parser(
        "show",
        parents=list(parents),
        help="the state of one job",
        description="The state of one job, its attempts, last error, next try and trace id (exit 7: unknown id).",
    )
    show.add_argument("id", help="a message id, or an idempotency key")
    show.add_argument("--json", action="store_true", help="print JSON for scripts")
    show.set_defaults(handler=_show)

    listing = actions.add_parser(
        "list",
        parents=list(parents),
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
    listing.add_argument("--json", action="store_true", help="print JSON for scripts")
    listing.set_defaults(handler=_list)

    cancel = actions.add_parser(
        "cancel",
        parents=list(parents),
        help="cancel a job: removed if it still waits in Postgres, else skipped on delivery or stopped",
        description=(
            "Cancel the job with this message id.  Still in the outbox or the Postgres queue table: its row is "
            "deleted.  Already in RabbitMQ, held or running: a tombstone makes workers skip it on delivery, and a "
            "running job stops at its next is_cancelled() check (needs the Cancellation middleware).  A job that "
            "already finished is left alone (exit 8); an unknown id changes nothing (exit 7)."
        ),
    )
    cancel.add_argument("id", metavar="ID", help="the job's Dramatiq message id")
    cancel.add_argument("--reason", help="why, kept with the cancellation for 'jobs show'")
    cancel.add_argument("--by", help="who cancels (default: user@host)")
    cancel.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    cancel.add_argument("--json", action="store_true", help="print JSON for scripts")
    cancel.set_defaults(handler=_cancel)
    return parser


def _show(args: argparse.Namespace) -> int:
    with connect(args, autocommit=True) as conn:
        try:
            status = show_job(conn, args.schema, args.id)
        except JobNotFound as error:
            print_error(str(error))
            return ExitCode.NOT_FOUND
        step = step_of(conn, args.schema, status.message_id)
    if args.json:
        output.print_json({**status.asdict(), "workflow": None if step is None else step.asdict()})
    else:
        print(_describe(status, step))
    return ExitCode.OK


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
    width = max(len(label) for label, _ in lines)
    return "\n".join(f"{label.ljust(width)}  {value}" for label, value in lines)


def _list(args: argparse.Namespace) -> int:
    with connect(args, autocommit=True) as conn:
        rows = list_jobs(conn, args.schema, state=args.state, actor=args.actor, queue=args.queue, limit=args.limit)
    if args.json:
        output.print_json([row.asdict() for row in rows])
        return ExitCode.OK
    if not rows:
        print(f"no {args.state} jobs")
        return ExitCode.OK
    output.print_table(
        ["MESSAGE", "ACTOR", "QUEUE", "ATTEMPTS", "SINCE", "ERROR"],
        [
            [
                row.message_id,
                row.actor_name,
                row.queue_name,
                str(row.attempts),
                output.ago(row.since),
                f"{row.error_type}: {row.error_message}" if row.error_type else row.error_message,
            ]
            for row in rows
        ],
        right=(3,),
        fit_last=True,
    )
    return ExitCode.OK


def _cancel(args: argparse.Namespace) -> int:
    if not confirm(args, f"cancel job {args.id}", f"cancel job {args.id}"):
        return ExitCode.ABORTED
    with open_database(args) as database:
        result = cancel_job(database, args.schema, args.id, by=check_by(args.by), reason=args.reason)
    if args.json:
        output.print_json(result.as_dict())
    elif result.outcome == UNKNOWN:
        print_error(
            f"no job with message id {args.id!r} in schema {args.schema!r} (not in the outbox, the queue table, "
            "the processed keys or the dead letters); nothing changed"
        )
    else:
        print(f"job {args.id}: {result.describe()}")
    if result.outcome == UNKNOWN:
        return ExitCode.NOT_FOUND
    if result.outcome == FINISHED:
        return ExitCode.REFUSED
    assert result.changed or result.outcome == ALREADY_CANCELLED
    return ExitCode.OK
