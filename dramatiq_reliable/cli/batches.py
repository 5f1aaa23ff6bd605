"""``dramatiq-reliable batches``: the progress of one batch by id, and its cancel.

::

    dramatiq-reliable batches show ID [--json]
    dramatiq-reliable batches cancel ID [--by NAME] [--reason TEXT] [--yes] [--json]

Both exit ``NOT_FOUND`` (7) for an id no batch has, as ``jobs show`` does.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ..database import Database
from ..dead_letters.validators import check_by
from ..workflows import BatchCancel, BatchStatus, batch_status, cancel_batch
from . import output
from .common import add_cancel, add_command, add_show, cancel_one, report_cancel, show_one

__all__ = ["register"]


def register(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    parents: Sequence[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add ``batches show`` and ``batches cancel``; ``parents`` supply ``--database-url`` and ``--schema``."""
    parser, actions = add_command(
        subparsers,
        "batches",
        help="the progress of a batch by id; cancel it",
        description="Batches of children with one completion callback: how many are done, dead, pending.",
    )
    add_show(
        actions,
        parents,
        _show,
        help="the progress of one batch",
        description="n of m children done, dead and pending, sealed, and when the callback fired (exit 7: unknown id).",
        id_help="the batch's id (Batch.id)",
    )
    add_cancel(
        actions,
        parents,
        _cancel,
        help="stop a batch: its callback never fires, unfinished children are cancelled as jobs",
        description="Cancel a batch that has not finished (exit 7: unknown id; a finished one is left alone).",
        id_help="the batch's id (Batch.id)",
        reason_help="why, kept with the batch for 'batches show'",
    )
    return parser


def _show(args: argparse.Namespace) -> int:
    return show_one(
        args, lambda conn: batch_status(conn, args.schema, args.id), as_dict=BatchStatus.asdict, describe=_describe
    )


def _cancel(args: argparse.Namespace) -> int:
    def report(result: BatchCancel) -> None:
        report_cancel("batch", result, f"its callback never fires, {len(result.jobs)} unfinished child(ren) cancelled")

    def cancel(database: Database) -> BatchCancel:
        return cancel_batch(database, args.schema, args.id, by=check_by(args.by), reason=args.reason)

    return cancel_one(args, "batch", cancel, as_dict=BatchCancel.asdict, report=report)


def _describe(status: BatchStatus) -> str:
    def when(value: object) -> str:
        return "-" if value is None else str(value)

    lines = [
        ("batch", status.id),
        ("state", status.state),
        ("progress", f"{status.done + status.dead} of {status.total} finished"),
        ("done", str(status.done)),
        ("dead", f"{status.dead} (if a child dies: {status.if_child_dies})"),
        ("pending", str(status.pending)),
        ("sealed", when(status.sealed_at)),
        ("callback", f"{status.callback_actor}, fired {when(status.fired_at)}"),
    ]
    if status.cancelled_at is not None:
        reason = f": {status.cancel_reason}" if status.cancel_reason else ""
        lines.append(("cancelled", f"by {status.cancelled_by} at {status.cancelled_at}{reason}"))
    return output.labelled(lines)
