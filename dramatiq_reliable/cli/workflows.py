"""``dramatiq-reliable workflows``: one workflow by id, and its cancel.

::

    dramatiq-reliable workflows show ID [--json]
    dramatiq-reliable workflows list [--state STATE] [--limit N] [--json]
    dramatiq-reliable workflows cancel ID [--by NAME] [--reason TEXT] [--yes] [--json]

Both exit ``NOT_FOUND`` (7) for an id no workflow has, as ``jobs show`` does.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from ..dead_letters.validators import check_by
from ..errors import JobNotFound
from ..workflows import WorkflowStatus, cancel_workflow, list_workflows, workflow_status
from ..workflows.state import STATES
from . import output
from .common import ExitCode, Integer, confirm, connect, open_database, print_error

__all__ = ["register"]


def register(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    parents: Sequence[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add ``workflows show`` and ``workflows cancel``; ``parents`` supply ``--database-url`` and ``--schema``."""
    parser = subparsers.add_parser(
        "workflows",
        help="one workflow by id: its steps and their states; cancel it",
        description="Chains of steps and groups: the state of each step, the results handed on, and a cancel.",
    )
    actions = parser.add_subparsers(dest="workflows_command", required=True, metavar="ACTION")
    show = actions.add_parser(
        "show",
        parents=list(parents),
        help="one workflow and its steps",
        description="The workflow's state and every step in order with its state (exit 7: unknown id).",
    )
    show.add_argument("id", help="the workflow's id (Workflow.id)")
    show.add_argument("--json", action="store_true", help="print JSON for scripts")
    show.set_defaults(handler=_show)
    listing = actions.add_parser(
        "list",
        parents=list(parents),
        help="the newest workflows",
        description="The newest workflows first, with their state and stage; 'workflows show ID' for the steps.",
    )
    listing.add_argument("--state", choices=STATES, help="only workflows in this state")
    listing.add_argument("--limit", type=Integer(minimum=1, maximum=10_000), default=50, help="how many (default 50)")
    listing.add_argument("--json", action="store_true", help="print JSON for scripts")
    listing.set_defaults(handler=_list)
    cancel = actions.add_parser(
        "cancel",
        parents=list(parents),
        help="stop a workflow: no later step is sent, sent steps are cancelled as jobs",
        description="Cancel a running workflow (exit 7: unknown id; a finished one is left alone).",
    )
    cancel.add_argument("id", help="the workflow's id (Workflow.id)")
    cancel.add_argument("--reason", help="why, kept with the workflow for 'workflows show'")
    cancel.add_argument("--by", help="who cancels (default: user@host)")
    cancel.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    cancel.add_argument("--json", action="store_true", help="print JSON for scripts")
    cancel.set_defaults(handler=_cancel)
    return parser


def _show(args: argparse.Namespace) -> int:
    with connect(args, autocommit=True) as conn:
        try:
            status = workflow_status(conn, args.schema, args.id)
        except JobNotFound as error:
            print_error(str(error))
            return ExitCode.NOT_FOUND
    if args.json:
        output.print_json(status.asdict())
    else:
        print(describe(status))
    return ExitCode.OK


def _list(args: argparse.Namespace) -> int:
    with connect(args, autocommit=True) as conn:
        rows = list_workflows(conn, args.schema, state=args.state, limit=args.limit)
    if args.json:
        output.print_json([row.asdict() for row in rows])
        return ExitCode.OK
    if not rows:
        print(f"no {args.state or ''} workflows".replace("  ", " "))
        return ExitCode.OK
    output.print_table(
        ["WORKFLOW", "STATE", "STAGE", "CREATED", "ERROR"],
        [
            [
                row.id,
                row.state,
                f"{min(row.stage + 1, row.stages)} of {row.stages}",
                output.ago(row.created_at),
                row.error or "",
            ]
            for row in rows
        ],
        fit_last=True,
    )
    return ExitCode.OK


def _cancel(args: argparse.Namespace) -> int:
    if not confirm(args, f"cancel workflow {args.id}", f"cancel workflow {args.id}"):
        return ExitCode.ABORTED
    with open_database(args) as database:
        try:
            result = cancel_workflow(database, args.schema, args.id, by=check_by(args.by), reason=args.reason)
        except JobNotFound as error:
            print_error(str(error))
            return ExitCode.NOT_FOUND
    if args.json:
        output.print_json(result.asdict())
    elif result.changed:
        print(
            f"workflow {result.id}: cancelled; {result.never_sent} step(s) never sent, {len(result.jobs)} job(s) cancelled"
        )
    else:
        print(f"workflow {result.id}: already {result.state}; nothing changed")
    return ExitCode.OK


def describe(status: WorkflowStatus) -> str:
    """The workflow for people: a header, then one line per step."""

    def when(value: object) -> str:
        return "-" if value is None else str(value)

    state = status.state + (" (waiting for a dead step's replay)" if status.waiting_for_replay else "")
    lines = [
        f"workflow  {status.id}",
        f"state     {state}",
        f"stage     {min(status.stage + 1, status.stages)} of {status.stages} (if a step dies: {status.if_step_dies})",
        f"created   {when(status.created_at)}",
        f"finished  {when(status.finished_at)}",
    ]
    if status.error:
        lines.append(f"error     {status.error}")
    if status.cancelled_by:
        lines.append(f"cancelled by {status.cancelled_by}")
    steps = output.table(
        ["STAGE", "STEP", "ACTOR", "STATE", "MESSAGE", "RESULT"],
        [
            [
                str(step.stage + 1),
                str(step.position + 1) if step.in_group else "-",
                step.actor_name,
                step.state,
                step.message_id,
                "-" if step.result is None else json.dumps(step.result),
            ]
            for step in status.steps
        ],
        right=(0, 1),
        fit_last=True,
    )
    return "\n".join([*lines, "", steps])
