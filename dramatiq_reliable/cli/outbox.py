"""``dramatiq-reliable outbox``: the backlog at a glance, a fresh start for failing rows, and the purge of published rows.

``outbox purge`` counts what it would delete and, on a terminal, asks first (a declined question
exits 6, ``ABORTED``); ``--yes`` skips the question.  Without a terminal it goes ahead, as the
other purges do: it deletes only rows past retention, and it runs from schedules.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ..outbox.admin import outbox_stats, published_older_than, retry_failing
from . import output
from .common import Duration, ExitCode, confirm, connect, open_database

__all__ = ["register"]


def register(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    parents: Sequence[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add ``outbox stats``, ``outbox retry`` and ``outbox purge``; ``parents`` supply ``--database-url`` and ``--schema``."""
    parser = subparsers.add_parser(
        "outbox",
        help="inspect and maintain the outbox",
        description="The outbox: messages committed with the app's transactions, waiting for the relay.",
    )
    actions = parser.add_subparsers(dest="outbox_command", required=True, metavar="ACTION")
    stats = actions.add_parser(
        "stats",
        parents=list(parents),
        help="backlog, failing rows, oldest age",
        description="Rows waiting for the relay, rows that failed to publish on their own, and the oldest row's age.",
    )
    stats.add_argument("--json", action="store_true", help="print JSON for scripts")
    stats.set_defaults(handler=_stats)
    retry = actions.add_parser(
        "retry",
        parents=list(parents),
        help="relay failing rows again now",
        description="Reset the attempts of every unpublished row that failed on its own, including rows the relay "
        "stopped trying after max_attempts, so the next relay pass publishes them.",
    )
    retry.add_argument("--json", action="store_true", help="print JSON for scripts")
    retry.set_defaults(handler=_retry)
    purge = actions.add_parser(
        "purge",
        parents=list(parents),
        help="delete published rows past retention",
        description="Delete published rows older than --older-than (a relay with --on-published mark keeps them). "
        "On a terminal it counts them and asks first (--yes skips the question); without a terminal (cron) it "
        "goes ahead, as the other purges do.",
    )
    purge.add_argument(
        "--older-than", type=Duration(), default="1d", metavar="DURATION", help="delete published rows older than this"
    )
    purge.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    purge.add_argument("--json", action="store_true", help="print JSON for scripts")
    purge.set_defaults(handler=_purge)
    return parser


def _stats(args: argparse.Namespace) -> int:
    with connect(args) as conn:
        stats = outbox_stats(conn, schema_name=args.schema)
    backlog, failing, oldest_s = stats.backlog, stats.failing, stats.oldest_age_s
    if args.json:
        output.print_json(
            {"backlog": backlog, "failing": failing, "oldest_age_s": oldest_s, "scheduled": stats.scheduled}
        )
        return ExitCode.OK
    print(f"backlog    {output.count(backlog, 'row')} due, waiting for the relay")
    print(f"failing    {output.count(failing, 'row')} failed to publish on their own; retried with backoff")
    print(f"oldest     {output.age(oldest_s) if backlog else '-'}")
    print(f"scheduled  {output.count(stats.scheduled, 'row')} waiting for their time (delays, retries' backoff)")
    return ExitCode.OK


def _retry(args: argparse.Namespace) -> int:
    with connect(args) as conn:
        reset = retry_failing(conn, schema_name=args.schema)
    if args.json:
        output.print_json({"reset": reset})
    else:
        print(f"reset {output.count(reset, 'failing row')}; the relays were woken to publish them")
    return ExitCode.OK


def _purge(args: argparse.Namespace) -> int:
    from ..outbox.relay import purge_published

    with open_database(args) as database:
        with database.connection() as conn:
            waiting = published_older_than(conn, schema_name=args.schema, older_than_ms=args.older_than)
        deleted = 0
        if waiting:
            rows = output.count(waiting, "published outbox row")
            question = f"delete {rows} older than {output.age(args.older_than / 1000)}"
            if not confirm(args, question, f"delete {rows}", unattended=True):
                return ExitCode.ABORTED
            deleted = purge_published(database, schema=args.schema, older_than_ms=args.older_than)
    if args.json:
        output.print_json({"deleted": deleted})
    else:
        print(f"deleted {output.count(deleted, 'published row')}")
    return ExitCode.OK
