"""``dramatiq-reliable scheduler``: the scheduler loop as a process, for the schedules of the given modules."""

from __future__ import annotations

import argparse
import importlib
import logging
import re
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from . import output
from .common import Duration, ExitCode, Integer, UsageError, open_database

if TYPE_CHECKING:
    from ..backing import SendsTo
    from ..scheduler.loop import SchedulerPass

__all__ = ["module_name", "register"]

logger = logging.getLogger("dramatiq_reliable.cli.scheduler")

_DESCRIPTION = """\
Fire the ticks of the schedules declared in MODULE (imported like 'dramatiq' imports its
modules: 'app.tasks', or 'app.tasks:broker' is read as 'app.tasks').  Syncs the declared
schedules at start (schedules no longer declared are disabled), then claims due schedules and,
in one transaction per pass, writes each tick's message, records the tick and advances the next
fire time.  Any number of schedulers may run at once: each tick fires exactly once.

The message goes into the outbox (a relay publishes it), or, with --target queue or a
PostgresBroker set by MODULE (--target auto), into the Postgres queue table.  It waits out
Postgres outages after start; at start an unreachable Postgres or missing tables exit at once.
SIGTERM or Ctrl-C finishes the pass in hand, then exits 0.  Its log (stderr, INFO) has one line
per pass that fired or skipped a tick.  With --once it runs one pass, prints what it did and exits.
"""

_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*(:[A-Za-z_][A-Za-z0-9_]*)?")


def module_name(text: str) -> str:
    """An argparse type: a dotted Python module name (``app.tasks``, or ``app.tasks:broker``)."""
    if not _MODULE.fullmatch(text) or len(text) > 200:
        shown = text if len(text) <= 60 else text[:57] + "..."
        raise argparse.ArgumentTypeError(f"{shown!r} is not a module name; give a dotted Python module like app.tasks")
    return text.split(":", 1)[0]


def register(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    parents: Sequence[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add ``scheduler``; ``parents`` supply ``--database-url`` and ``--schema``."""
    parser = subparsers.add_parser(
        "scheduler",
        parents=list(parents),
        help="fire the ticks of declared schedules",
        description=_DESCRIPTION,
    )
    parser.add_argument("modules", nargs="+", type=module_name, metavar="MODULE", help="modules that declare schedules")
    parser.add_argument(
        "--path",
        default=".",
        metavar="DIR",
        help="directory put first on the import path, where MODULE is looked for",
    )
    parser.add_argument(
        "--target",
        choices=["auto", "outbox", "queue"],
        default="auto",
        help="where a tick's message goes: auto is queue when MODULE set a PostgresBroker, else outbox",
    )
    parser.add_argument(
        "--batch-size", type=Integer(minimum=1), default=500, metavar="N", help="schedules claimed per pass"
    )
    parser.add_argument(
        "--poll-interval",
        type=Duration(minimum_ms=1),
        default="1s",
        metavar="DURATION",
        help="longest sleep between passes",
    )
    parser.add_argument(
        "--lead",
        type=Duration(minimum_ms=0),
        default="0s",
        metavar="DURATION",
        help="write the ticks of overlap='allow' schedules this long before their fire time, due then "
        "(see docs/scheduling.md)",
    )
    parser.add_argument("--once", action="store_true", help="sync, run one pass, print what it did and exit")
    # A long-running process's log is its output: INFO unless asked otherwise.
    parser.set_defaults(handler=_scheduler, log_level=logging.INFO)
    return parser


def _scheduler(args: argparse.Namespace) -> int:
    from ..scheduler.loop import Scheduler

    registry = _import(args.path, args.modules)
    target = _target(args.target)
    with open_database(args) as database:
        scheduler = Scheduler(
            database=database,
            schema=args.schema,
            registry=registry,
            batch_size=args.batch_size,
            poll_interval_ms=args.poll_interval,
            target=target,
            lead_ms=args.lead,
        )
        # At start, fail fast and say why (unreachable, not migrated); later outages are waited out.
        changed, disabled = scheduler.sync()
        logger.info(
            "scheduler for schema %r: %s declared (%d changed, %d disabled), ticks into the %s",
            args.schema,
            output.count(len(list(registry)), "schedule"),
            len(changed),
            len(disabled),
            target,
        )
        if args.once:
            result = scheduler.tick_once()
            print(f"fired {output.count(result.fired, 'tick')}, skipped {result.skipped:,}")
            return ExitCode.OK

        def stop(signum: int, _frame: Any) -> None:
            logger.info("received %s: finishing the pass in hand", signal.Signals(signum).name)
            scheduler.stop()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        scheduler.run(sync=False, on_pass=_log_pass)
    return ExitCode.OK


def _log_pass(result: SchedulerPass) -> None:
    if result.fired or result.skipped:
        logger.info("fired %s, skipped %d", output.count(result.fired, "tick"), result.skipped)


def _import(path: str, modules: Sequence[str]) -> Any:
    from ..scheduler.registry import default_registry

    sys.path.insert(0, path)
    for name in modules:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as error:
            if error.name is not None and (name == error.name or name.startswith(error.name + ".")):
                raise UsageError(
                    f"cannot import module {name!r}: no such module on the path (--path {path!r}); "
                    "give the dotted name of the module that declares the schedules"
                ) from None
            raise
    if not list(default_registry):
        raise UsageError(
            f"no schedules are declared in {', '.join(repr(m) for m in modules)}; "
            "declare them there with schedule(...), or name the module that does"
        )
    return default_registry


def _target(choice: str) -> SendsTo:
    if choice == "outbox":
        return "outbox"
    if choice == "queue":
        return "queue"
    import dramatiq.broker

    from ..backing import postgres_backed

    # The global broker only if MODULE set one: get_broker() would make a RabbitMQ one.
    backed = postgres_backed(dramatiq.broker.global_broker)
    return backed.sends_to if backed is not None else "outbox"
