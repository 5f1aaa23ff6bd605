"""``dramatiq-reliable partitions``: the partitioned history of published outbox rows."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from . import output
from .common import Duration, ExitCode, Integer, open_database

__all__ = ["register"]


def register(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    parents: Sequence[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add ``partitions enable|maintain|status|disable``; ``parents`` supply ``--database-url`` and ``--schema``."""
    parser = subparsers.add_parser(
        "partitions",
        help="keep published outbox rows in time partitions, dropped whole",
        description="Published outbox rows move to a table partitioned by publish time; retention drops "
        "whole partitions instead of deleting rows (no bloat, little WAL).  Opt-in, no downtime.",
    )
    actions = parser.add_subparsers(dest="partitions_command", required=True, metavar="ACTION")
    enable = actions.add_parser(
        "enable",
        parents=list(parents),
        help="partition published rows (safe while relays run)",
        description="Make the partitions, install the trigger that moves rows as relays mark them, then move "
        "the published rows kept today in short transactions.  Running it again changes --ahead and --retention.",
    )
    enable.add_argument("--interval", type=Duration(), default="1d", metavar="DURATION", help="width of a partition")
    enable.add_argument(
        "--ahead", type=Integer(minimum=1), default=3, metavar="N", help="partitions made ahead of the clock"
    )
    enable.add_argument(
        "--retention", type=Duration(), default="1d", metavar="DURATION", help="how long published rows are kept"
    )
    maintain = actions.add_parser(
        "maintain",
        parents=list(parents),
        help="make partitions ahead, drop expired ones",
        description="What every relay runs each purge interval; schedule it (e.g. hourly) when no relay runs.",
    )
    status = actions.add_parser(
        "status", parents=list(parents), help="show the partitions", description="Settings and partitions."
    )
    disable = actions.add_parser(
        "disable",
        parents=list(parents),
        help="stop moving published rows",
        description="Published rows stay in the outbox again; existing partitions are left for you to drop.",
    )
    for action, handler in ((enable, _enable), (maintain, _maintain), (status, _status), (disable, _disable)):
        action.add_argument("--json", action="store_true", help="print JSON for scripts")
        action.set_defaults(handler=handler)
    return parser


def _enable(args: argparse.Namespace) -> int:
    from ..partitions import enable

    with open_database(args) as database:
        report = enable(
            database, schema=args.schema, interval_ms=args.interval, ahead=args.ahead, retention_ms=args.retention
        )
    return _show(args, report)


def _maintain(args: argparse.Namespace) -> int:
    from ..partitions import maintain

    with open_database(args) as database:
        report = maintain(database, schema=args.schema)
    if not report.enabled and not args.json:
        print("partitions are not enabled on this schema; run 'dramatiq-reliable partitions enable'")
        return ExitCode.OK
    return _show(args, report)


def _status(args: argparse.Namespace) -> int:
    from ..partitions import partition_status

    with open_database(args) as database:
        report = partition_status(database, schema=args.schema)
    if not report.enabled and not args.json:
        print("partitions are not enabled on this schema; published rows are purged row by row")
        return ExitCode.OK
    return _show(args, report)


def _disable(args: argparse.Namespace) -> int:
    from ..partitions import disable

    with open_database(args) as database:
        disable(database, schema=args.schema)
    if args.json:
        output.print_json({"enabled": False})
    else:
        print("disabled: published rows stay in the outbox again; the partitions are left as they are")
    return ExitCode.OK


def _show(args: argparse.Namespace, report: Any) -> int:
    if args.json:
        output.print_json(
            {
                "enabled": report.enabled,
                "interval_ms": report.interval_ms,
                "ahead": report.ahead,
                "retention_ms": report.retention_ms,
                "partitions": [{"name": p.name, "from": p.lower, "to": p.upper} for p in report.partitions],
                "covered_until": report.covered_until,
                "created": list(report.created),
                "dropped": list(report.dropped),
                "moved": report.moved,
                "left_in_outbox": report.left_in_outbox,
                "skipped": report.skipped,
            }
        )
        return ExitCode.OK
    if report.skipped:
        print("another maintainer holds the lease; nothing done this time")
    for partition in report.partitions:
        print(f"{partition.name}  {partition.lower:%Y-%m-%d %H:%M} .. {partition.upper:%Y-%m-%d %H:%M}")
    print(
        f"made {len(report.created)}, dropped {len(report.dropped)}, moved {output.count(report.moved, 'row')}; "
        f"{output.count(report.left_in_outbox, 'published row')} left in the outbox"
    )
    return ExitCode.OK
