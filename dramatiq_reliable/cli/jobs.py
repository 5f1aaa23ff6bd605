"""The ``dramatiq-reliable jobs`` command: act on one job by its message id.

::

    dramatiq-reliable jobs cancel ID [--reason TEXT] [--by NAME] [--yes] [--json]

``cancel`` asks for confirmation on a terminal; ``--yes`` skips it, and without a terminal and
without ``--yes`` it is refused (exit ``ABORTED``).  Exit codes: ``OK`` when the job is
cancelled now or was already, ``NOT_FOUND`` (7) when Postgres holds nothing of that id, and
``REFUSED`` (8) when the job already finished (done or dead) and so was left alone.

``cli/__init__.py`` adds this command with :func:`register`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ..dead_letters.validators import check_by
from ..jobs.cancel import ALREADY_CANCELLED, FINISHED, UNKNOWN, cancel_job
from . import output
from .common import ExitCode, confirm, open_database, print_error

__all__ = ["register"]


def register(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    common_parents: Sequence[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add ``jobs`` and its actions to ``subparsers``; each action sets ``handler``."""
    parser = subparsers.add_parser(
        "jobs",
        help="act on one job by its message id (cancel)",
        description="One job by its Dramatiq message id, wherever it is: the outbox, a queue, or running.",
    )
    actions = parser.add_subparsers(dest="jobs_command", required=True, metavar="ACTION")
    cancel = actions.add_parser(
        "cancel",
        parents=list(common_parents),
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
