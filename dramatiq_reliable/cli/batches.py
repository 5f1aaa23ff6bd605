"""``dramatiq-reliable batches``: the progress of one batch by id.

::

    dramatiq-reliable batches show ID [--json]

``batches show ID`` exits ``NOT_FOUND`` (7) for an id no batch has, as ``jobs show`` does.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ..errors import JobNotFound
from ..workflows import BatchStatus, batch_status
from . import output
from .common import ExitCode, connect, print_error

__all__ = ["register"]


def register(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    parents: Sequence[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add ``batches show``; ``parents`` supply ``--database-url`` and ``--schema``."""
    parser = subparsers.add_parser(
        "batches",
        help="the progress of a batch by id",
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
    width = max(len(label) for label, _ in lines)
    return "\n".join(f"{label.ljust(width)}  {value}" for label, value in lines)
