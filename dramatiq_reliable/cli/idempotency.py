"""``dramatiq-reliable idempotency``: maintenance of the processed-job keys."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from . import output
from .common import ExitCode, Integer, open_database

__all__ = ["register"]


def register(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    parents: Sequence[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add ``idempotency purge``; ``parents`` supply ``--database-url`` and ``--schema``."""
    parser = subparsers.add_parser(
        "idempotency",
        help="maintain processed-job keys",
        description="The keys that make a redelivered job a no-op, kept for each actor's retention.",
    )
    actions = parser.add_subparsers(dest="idempotency_command", required=True, metavar="ACTION")
    purge = actions.add_parser(
        "purge",
        parents=list(parents),
        help="delete expired idempotency keys",
        description="Delete the keys past their retention, in short transactions (schedule it, e.g. hourly).",
    )
    purge.add_argument(
        "--batch-size", type=Integer(minimum=1), default=5000, metavar="N", help="keys deleted per transaction"
    )
    purge.add_argument("--json", action="store_true", help="print JSON for scripts")
    purge.set_defaults(handler=_purge)
    return parser


def _purge(args: argparse.Namespace) -> int:
    from ..idempotency import purge_expired

    with open_database(args) as database:
        deleted = purge_expired(database, schema=args.schema, batch_size=args.batch_size)
    if args.json:
        output.print_json({"deleted": deleted})
    else:
        print(f"deleted {output.count(deleted, 'expired idempotency key')}")
    return ExitCode.OK
