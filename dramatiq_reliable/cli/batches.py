"""``dramatiq-reliable batches``: the progress of one batch by id, and its cancel.

::

    dramatiq-reliable batches show ID [--json]
    dramatiq-reliable batches cancel ID [--by NAME] [--reason TEXT] [--yes] [--json]

Both exit ``NOT_FOUND`` (7) for an id no batch has, as ``jobs show`` does.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ..dead_letters.validators import check_by
from ..errors import JobNotFound
from ..workflows import BatchStatus, batch_status, cancel_batch
from . import output
from .common import ExitCode, confirm, connect, open_database, print_error

__all__ = ["register"]


def register(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    parents: Sequence[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add ``batches show`` and ``batches cancel``; ``parents`` supply ``--database-url`` and ``--schema``."""
    parser = subparsers.add_parser(
        "batches",
        help="the progress of a batch by id; cancel it",
        description="Batches of children with one completion callback: how many are done, dead, pending.",
    )
    actions = parser.add_subparsers(dest="batches_command", required=True, metavar="ACTION")
    show = actions.add_parser(
        "show",
        parents=list(parents),
        help="the progress of one batch",
        description="n of m children done, dead and pending, sealed, and when the callback fired (exit 7: unknown id).",
    )
    show.add_argument("id", help="the batch's id (Batch.id)")
    show.add_argument("--json", action="store_true", help="print JSON for scripts")
    show.set_defaults(handler=_show)
    cancel = actions.add_parser(
        "cancel",
        parents=list(parents),
        help="stop a batch: its callback never fires, unfinished children are cancelled as jobs",
        description="Cancel a batch that has not finished (exit 7: unknown id; a finished one is left alone).",
    )
    cancel.add_argument("id", help="the batch's id (Batch.id)")
    cancel.add_argument("--reason", help="why, kept with the batch for 'batches show'")
    cancel.add_argument("--by", help="who cancels (default: user@host)")
    cancel.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    cancel.add_argument("--json", action="store_true", help="print JSON for scripts")
    cancel.set_defaults(handler=_cancel)
    return parser


def _show(args: argparse.Namespace) -> int:
    with connect(args, autocommit=True) as conn:
        try:
            status = batch_status(conn, args.schema, args.id)
        except JobNotFound as error:
            print_error(str(error))
            return ExitCode.NOT_FOUND
    if args.json:
        output.print_json(status.asdict())
    else:
        print(_describe(status))
    return ExitCode.OK


def _cancel(args: argparse.Namespace) -> int:
    if not confirm(args, f"cancel batch {args.id}", f"cancel batch {args.id}"):
        return ExitCode.ABORTED
    with open_database(args) as database:
        try:
            result = cancel_batch(database, args.schema, args.id, by=check_by(args.by), reason=args.reason)
        except JobNotFound as error:
            print_error(str(error))
            return ExitCode.NOT_FOUND
    if args.json:
        output.print_json(result.asdict())
    elif result.changed:
        print(
            f"batch {result.id}: cancelled; its callback never fires, {len(result.jobs)} unfinished child(ren) cancelled"
        )
    else:
        print(f"batch {result.id}: already {result.state}; nothing changed")
    return ExitCode.OK


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
    width = max(len(label) for label, _ in lines)
    return "\n".join(f"{label.ljust(width)}  {value}" for label, value in lines)
