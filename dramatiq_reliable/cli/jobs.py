"""``dramatiq-reliable jobs``: look a job up by message id or idempotency key, and list jobs by state.

``jobs show ID`` exits ``NOT_FOUND`` (7) for an id no table knows.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ..errors import JobNotFound
from ..jobs.lookup import LISTABLE_STATES, JobStatus, list_jobs, show_job
from . import output
from .common import ExitCode, Integer, connect, print_error

__all__ = ["register"]


def register(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    parents: Sequence[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add ``jobs show`` and ``jobs list``; ``parents`` supply ``--database-url`` and ``--schema``."""
    parser = subparsers.add_parser(
        "jobs",
        help="look jobs up by id, list them by state",
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
    return parser


def _show(args: argparse.Namespace) -> int:
    with connect(args, autocommit=True) as conn:
        try:
            status = show_job(conn, args.schema, args.id)
        except JobNotFound as error:
            print_error(str(error))
            return ExitCode.NOT_FOUND
    if args.json:
        output.print_json(status.asdict())
    else:
        print(_describe(status))
    return ExitCode.OK


def _describe(status: JobStatus) -> str:
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
