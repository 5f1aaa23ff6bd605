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

from ..database import Database
from ..dead_letters.validators import check_by
from ..workflows import WorkflowCancel, WorkflowStatus, cancel_workflow, list_workflows, workflow_status
from ..workflows.state import STATES
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
    report_cancel,
    show_one,
)

__all__ = ["register"]


def register(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    parents: Sequence[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add ``workflows show`` and ``workflows cancel``; ``parents`` supply ``--database-url`` and ``--schema``."""
    parser, actions = add_command(
        subparsers,
        "workflows",
        help="one workflow by id: its steps and their states; cancel it",
        description="Chains of steps and groups: the state of each step, the results handed on, and a cancel.",
    )
    add_show(
        actions,
        parents,
        _show,
        help="one workflow and its steps",
        description="The workflow's state and every step in order with its state (exit 7: unknown id).",
        id_help="the workflow's id (Workflow.id)",
    )
    listing = add_action(
        actions,
        "list",
        parents,
        _list,
        help="the newest workflows",
        description="The newest workflows first, with their state and stage; 'workflows show ID' for the steps.",
    )
    listing.add_argument("--state", choices=STATES, help="only workflows in this state")
    listing.add_argument("--limit", type=Integer(minimum=1, maximum=10_000), default=50, help="how many (default 50)")
    add_json(listing)
    add_cancel(
        actions,
        parents,
        _cancel,
        help="stop a workflow: no later step is sent, sent steps are cancelled as jobs",
        description="Cancel a running workflow (exit 7: unknown id; a finished one is left alone).",
        id_help="the workflow's id (Workflow.id)",
        reason_help="why, kept with the workflow for 'workflows show'",
    )
    return parser


def _show(args: argparse.Namespace) -> int:
    return show_one(
        args, lambda conn: workflow_status(conn, args.schema, args.id), as_dict=WorkflowStatus.asdict, describe=describe
    )


def _list(args: argparse.Namespace) -> int:
    with connect(args, autocommit=True) as conn:
        rows = list_workflows(conn, args.schema, state=args.state, limit=args.limit)
    output.print_rows(
        rows,
        as_json=args.json,
        empty=f"no {args.state or ''} workflows".replace("  ", " "),
        headers=["WORKFLOW", "STATE", "STAGE", "CREATED", "ERROR"],
        cells=lambda row: [
            row.id,
            row.state,
            f"{min(row.stage + 1, row.stages)} of {row.stages}",
            output.ago(row.created_at),
            row.error or "",
        ],
    )
    return ExitCode.OK


def _cancel(args: argparse.Namespace) -> int:
    def report(result: WorkflowCancel) -> None:
        report_cancel(
            "workflow", result, f"{result.never_sent} step(s) never sent, {len(result.jobs)} job(s) cancelled"
        )

    def cancel(database: Database) -> WorkflowCancel:
        return cancel_workflow(database, args.schema, args.id, by=check_by(args.by), reason=args.reason)

    return cancel_one(args, "workflow", cancel, as_dict=WorkflowCancel.asdict, report=report)


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
