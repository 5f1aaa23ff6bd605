"""The ``dramatiq-reliable schedules`` command: see the stored schedules, pause, resume, trigger one run.

::

    dramatiq-reliable schedules list    [--name NAME] [--json]
    dramatiq-reliable schedules pause   NAME [--json]
    dramatiq-reliable schedules resume  NAME [--json]
    dramatiq-reliable schedules trigger NAME [--json]

A thin layer over :mod:`dramatiq_reliable.scheduler.admin` (the web page calls the same
functions).  Exit codes are :class:`~.common.ExitCode` values: ``NOT_FOUND`` (7) for a name no
schedule has, ``REFUSED`` (8) for a trigger of a schedule removed from code.
"""

from __future__ import annotations

import argparse
import datetime as dt
from collections.abc import Sequence

from ..backing import target_unknown
from ..errors import ScheduleDisabled, ScheduleNotFound, TargetUnknown
from ..scheduler.admin import ScheduleStatus, list_schedules, pause_schedule, resume_schedule, trigger_schedule
from . import output
from .common import ExitCode, UsageError, open_database, print_error

__all__ = ["register"]

_UTC = dt.timezone.utc


def register(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    parents: Sequence[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add ``schedules list|pause|resume|trigger``; ``parents`` supply ``--database-url`` and ``--schema``."""
    parser = subparsers.add_parser(
        "schedules",
        help="see, pause, resume and trigger scheduled jobs",
        description="Schedules declared in code and stored in Postgres: their next and last runs, pause, resume, "
        "and one run now.",
    )
    actions = parser.add_subparsers(dest="schedules_command", required=True, metavar="ACTION")
    json_ = argparse.ArgumentParser(add_help=False)
    json_.add_argument("--json", action="store_true", help="print JSON for scripts (times in UTC and local)")
    name = argparse.ArgumentParser(add_help=False)
    name.add_argument("name", metavar="NAME", help="the schedule's name, as 'schedules list' shows it")

    list_ = actions.add_parser(
        "list",
        parents=[*parents, json_],
        help="every schedule with its next run, last run and outcome",
        description="Every stored schedule: its timing in words, time zone, next run in its zone and in UTC, "
        "last run and that run's outcome, and whether it is paused or disabled (removed from code).",
    )
    list_.add_argument("--name", help="only this schedule")
    list_.set_defaults(handler=_list)

    pause = actions.add_parser(
        "pause",
        parents=[*parents, name, json_],
        help="stop a schedule firing until it is resumed",
        description="Stop NAME firing on every scheduler until 'schedules resume'. A pause survives restarts and "
        "deploys; 'schedules trigger' still runs it by hand.",
    )
    pause.set_defaults(handler=_pause)

    resume = actions.add_parser(
        "resume",
        parents=[*parents, name, json_],
        help="let a paused schedule fire again, from its next tick",
        description="Let NAME fire again from its first tick after now. The ticks that fell while it was paused "
        "are never fired, whatever its missed-tick policy.",
    )
    resume.set_defaults(handler=_resume)

    trigger = actions.add_parser(
        "trigger",
        parents=[*parents, name, json_],
        help="run a schedule once now, through the outbox",
        description="Send one run of NAME now, through the outbox, recorded as a tick with reason 'manual' in the "
        "same transaction; prints its message id. Works on a paused schedule; refused for one removed from code.",
    )
    trigger.add_argument(
        "--to",
        choices=("outbox", "queue"),
        default=None,
        help="where the run goes: the outbox (OutboxBroker) or the Postgres queues (PostgresBroker); default: "
        "read from the schema (the one of the two that was ever written to)",
    )
    trigger.set_defaults(handler=_trigger)
    return parser


# --------------------------------------------------------------------------------------------
# Handlers
# --------------------------------------------------------------------------------------------


def _list(args: argparse.Namespace) -> int:
    with open_database(args, max_size=1) as database:
        try:
            rows = list_schedules(database, schema=args.schema, name=args.name)
        except ScheduleNotFound as error:
            return _not_found(error)
    if args.json:
        output.print_json([row.to_json() for row in rows])
        return ExitCode.OK
    if not rows:
        print(
            f"no schedule is stored in schema {args.schema!r}; a process that declares schedules stores them "
            "when it starts (Scheduler.sync)"
        )
        return ExitCode.OK
    now = dt.datetime.now(_UTC)
    output.print_table(
        ["NAME", "SCHEDULE", "TZ", "NEXT RUN (LOCAL)", "NEXT RUN (UTC)", "LAST RUN", "OUTCOME", "STATE"],
        [
            [
                row.name,
                row.explain,
                row.tz,
                _local(row, row.next_fire_at),
                _utc(row.next_fire_at),
                _last_run(row.last_fire_at, now),
                _outcome(row),
                _state(row),
            ]
            for row in rows
        ],
        max_width=48,
    )
    return ExitCode.OK


def _pause(args: argparse.Namespace) -> int:
    with open_database(args, max_size=1) as database:
        try:
            row = pause_schedule(database, args.name, schema=args.schema)
        except ScheduleNotFound as error:
            return _not_found(error)
    return _report(args, row, f"paused {row.name!r}; 'schedules resume {row.name}' lets it fire again")


def _resume(args: argparse.Namespace) -> int:
    with open_database(args, max_size=1) as database:
        try:
            row = resume_schedule(database, args.name, schema=args.schema)
        except ScheduleNotFound as error:
            return _not_found(error)
    if row.enabled:
        text = f"resumed {row.name!r}; next run {_local(row, row.next_fire_at)} ({_utc(row.next_fire_at)})"
    else:
        text = f"resumed {row.name!r}, but it is disabled (no longer declared in code) and does not fire"
    return _report(args, row, text)


def _trigger(args: argparse.Namespace) -> int:
    with open_database(args, max_size=1) as database:
        try:
            message_id = trigger_schedule(database, args.name, schema=args.schema, target=args.to)
        except TargetUnknown:
            raise UsageError(
                str(target_unknown("manual runs", args.schema, outbox="--to outbox", queue="--to queue"))
            ) from None
        except ScheduleNotFound as error:
            return _not_found(error)
        except ScheduleDisabled as error:
            print_error(str(error))
            return ExitCode.REFUSED
    if args.json:
        output.print_json({"name": args.name, "message_id": message_id})
    else:
        print(message_id)
    return ExitCode.OK


# --------------------------------------------------------------------------------------------
# Formatting
# --------------------------------------------------------------------------------------------


def _report(args: argparse.Namespace, row: ScheduleStatus, text: str) -> int:
    if args.json:
        output.print_json(row.to_json())
    else:
        print(text)
    return ExitCode.OK


def _not_found(error: ScheduleNotFound) -> int:
    print_error(str(error))
    return ExitCode.NOT_FOUND


def _local(row: ScheduleStatus, moment: dt.datetime | None) -> str:
    local = row.local(moment)
    return "-" if local is None else local.strftime("%Y-%m-%d %H:%M:%S %Z")


def _utc(moment: dt.datetime | None) -> str:
    return "-" if moment is None else moment.astimezone(_UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _outcome(row: ScheduleStatus) -> str:
    if row.last_state is None:
        return "-"
    return row.last_state if row.last_reason is None else f"{row.last_state} ({row.last_reason})"


def _state(row: ScheduleStatus) -> str:
    if not row.enabled:
        return "disabled"
    return "paused" if row.paused else "active"


def _last_run(last_fire_at: dt.datetime | None, now: dt.datetime) -> str:
    """``4.0s ago``; a tick written ahead (``lead_ms``), not due yet, is ``in 1.5s``."""
    if last_fire_at is None:
        return "-"
    if last_fire_at > now:
        return f"in {output.age((last_fire_at - now).total_seconds())}"
    return f"{output.ago(last_fire_at, now)} ago"
