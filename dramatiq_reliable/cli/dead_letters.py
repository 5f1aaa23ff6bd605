"""The ``dramatiq-reliable dead-letters`` command: see, group, replay, discard and purge dead letters.

::

    dramatiq-reliable dead-letters list    [FILTERS] [--state STATE] [--limit N] [--cursor C] [--json]
    dramatiq-reliable dead-letters show    ID [--json]
    dramatiq-reliable dead-letters stats   [FILTERS] [--limit N] [--json]
    dramatiq-reliable dead-letters replay  [ID ...] [FILTERS | --all] [--to-queue Q] [--delay 30s]
                                           [--max-age 7d | --force] [--yes] [--json]
    dramatiq-reliable dead-letters discard [ID ...] [FILTERS | --all] [--reason TEXT] [--yes] [--json]
    dramatiq-reliable dead-letters purge   [--older-than 30d] [--handled-older-than 0s] [--json]
    dramatiq-reliable dead-letters import-xq --queue Q [--queue Q ...] [--rabbitmq-url URL] [--json]

    FILTERS: --actor NAME --queue NAME --error-type TYPE --fingerprint FP --since WHEN --until WHEN

Readable tables by default, ``--json`` for scripts.  A bulk replay or discard (by filter, not by
id) asks for confirmation; ``--yes`` skips it, and without a terminal and without ``--yes`` it is
refused.  Exit codes are :class:`~dramatiq_reliable.cli.ExitCode` values plus ``NOT_FOUND`` and
``REFUSED`` (see :data:`NOT_FOUND`, :data:`REFUSED`).

``cli/__init__.py`` adds this command with :func:`register`; tables, ages and ``--json`` are
:mod:`.output`'s, errors go through :func:`~.common.print_error`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import re
import sys
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

from ..dead_letters import (
    DEFAULT_REPLAY_MAX_AGE_MS,
    DEFAULT_RETENTION_MS,
    DeadLetter,
    DeadLetterFilter,
    PostgresDeadLetterStore,
    import_xq,
)
from ..dead_letters.selection import Selection
from ..errors import ConfigurationError
from . import common, output
from .common import (
    BIGINT_MAX,
    DURATION,
    Duration,
    ExitCode,
    Integer,
    duration_ms,
    open_database,
    print_error,
    queue_name,
    rabbitmq_parameters,
    sends_to,
)

__all__ = ["NOT_FOUND", "REFUSED", "register"]

logger = logging.getLogger("dramatiq_reliable.cli")


#: A dead letter asked for by id does not exist.
NOT_FOUND = ExitCode.NOT_FOUND
#: Some dead letters were left alone: first sent too long ago (without ``--force``), or
#: already replayed or discarded.  The others were handled.
REFUSED = ExitCode.REFUSED

_STATE_CHOICES = ("dead", "replayed", "discarded", "all")


def point_in_time(text: str, *, now: datetime.datetime | None = None) -> datetime.datetime:
    """An ISO 8601 date or time (UTC unless it says otherwise), or a duration meaning that long ago."""
    text = text.strip()
    now = now or datetime.datetime.now(datetime.timezone.utc)
    if DURATION.match(text.lower()):
        return now - datetime.timedelta(milliseconds=duration_ms(text))
    try:
        value = datetime.datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a time; write an ISO date or time (2024-05-01, 2024-05-01T12:00:00+02:00) "
            "or a duration meaning that long ago (2h, 3d)"
        ) from None
    return value if value.tzinfo is not None else value.replace(tzinfo=datetime.timezone.utc)


_positive_int = Integer(minimum=1)
_CURSOR = re.compile(r"-?\d{1,19}\.\d{1,19}")
# A cursor's first part is microseconds since 1970; datetime ends in year 9999.
_MAX_CURSOR_US = 253_402_300_799 * 1_000_000


def _cursor(text: str) -> str:
    """A cursor as a listing printed it (checked here, so a mangled one is a usage error)."""
    if _CURSOR.fullmatch(text):
        micros, dead_letter_id = (int(part) for part in text.split("."))
        if abs(micros) <= _MAX_CURSOR_US and dead_letter_id <= BIGINT_MAX:
            return text
    raise argparse.ArgumentTypeError(f"{text[:60]!r} is not a cursor a listing printed; pass it unchanged")


# --------------------------------------------------------------------------------------------
# The parser
# --------------------------------------------------------------------------------------------


def register(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    common_parents: Sequence[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add ``dead-letters`` and its actions to ``subparsers``.

    ``common_parents`` are the parent parsers every command of ``dramatiq-reliable`` takes
    (``--database-url``, ``--schema``).  Each action sets ``handler`` to a function of the
    parsed arguments returning an exit code, as the other commands do.
    """
    parents = list(common_parents)
    parser = subparsers.add_parser(
        "dead-letters",
        help="see, group, replay and discard failed messages",
        description="Messages that failed for good, kept in Postgres: see, group, fix, replay, discard.",
    )
    actions = parser.add_subparsers(dest="dead_letters_command", required=True, metavar="ACTION")

    filters = argparse.ArgumentParser(add_help=False)
    group = filters.add_argument_group("filters")
    group.add_argument("--actor", dest="actor_name", help="actor name")
    group.add_argument("--queue", dest="queue_name", type=queue_name, help="queue name (without .DQ/.XQ)")
    group.add_argument("--error-type", help="exception type as shown by list, e.g. ValueError or app.errors.Declined")
    group.add_argument("--fingerprint", help="group fingerprint, as shown by stats")
    group.add_argument("--since", type=point_in_time, help="last failure at or after: ISO time, or 2h for 2h ago")
    group.add_argument("--until", type=point_in_time, help="last failure before: ISO time, or 2h for 2h ago")
    output = argparse.ArgumentParser(add_help=False)
    output.add_argument("--json", action="store_true", help="print JSON for scripts")
    bulk = argparse.ArgumentParser(add_help=False)
    bulk.add_argument("ids", nargs="*", type=_positive_int, metavar="ID", help="dead letter ids")
    bulk.add_argument("--all", action="store_true", help="every dead letter (with no ids and no filter)")
    bulk.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")

    list_ = actions.add_parser("list", parents=[*parents, filters, output], help="list dead letters, newest first")
    list_.add_argument("--state", choices=_STATE_CHOICES, default="dead", help="default: dead")
    list_.add_argument("--limit", type=_positive_int, default=50, help="rows per page (default 50)")
    list_.add_argument("--cursor", type=_cursor, help="the next page: the cursor a previous page printed")
    list_.set_defaults(handler=_list)

    show = actions.add_parser("show", parents=[*parents, output], help="one dead letter with its traceback")
    show.add_argument("id", type=_positive_int, metavar="ID")
    show.set_defaults(handler=_show)

    stats = actions.add_parser(
        "stats", parents=[*parents, filters, output], help="dead letters grouped by error and code location"
    )
    stats.add_argument("--limit", type=_positive_int, default=20, help="groups shown (default 20)")
    stats.set_defaults(handler=_stats)

    replay = actions.add_parser(
        "replay",
        parents=[*parents, filters, output, bulk],
        help="send dead letters again, through the outbox (or onto the Postgres queues with --to queue)",
    )
    replay.add_argument("--to-queue", type=queue_name, help="send to this queue instead of the original one")
    replay.add_argument("--delay", type=Duration(), help="deliver after this long, e.g. 10m")
    replay.add_argument(
        "--max-age",
        type=Duration(),
        default=DEFAULT_REPLAY_MAX_AGE_MS,
        help="refuse jobs first sent longer ago than this (default 7d)",
    )
    replay.add_argument("--force", action="store_true", help="replay however old the job is")
    replay.add_argument(
        "--to",
        choices=("outbox", "queue"),
        default=None,
        help="where replays go: the outbox (OutboxBroker) or the Postgres queues (PostgresBroker); default: "
        "read from the schema (the one of the two that was ever written to)",
    )
    replay.set_defaults(handler=_replay)

    discard = actions.add_parser(
        "discard", parents=[*parents, filters, output, bulk], help="mark dead letters discarded, on purpose"
    )
    discard.add_argument("--reason", help="why, for the audit trail")
    discard.set_defaults(handler=_discard)

    purge = actions.add_parser("purge", parents=[*parents, output], help="delete handled and expired dead letters")
    purge.add_argument(
        "--older-than",
        type=Duration(),
        default=DEFAULT_RETENTION_MS,
        help="delete dead letters whose last failure is older (default 30d)",
    )
    purge.add_argument("--keep-dead", action="store_true", help="delete no dead letter still in state dead")
    purge.add_argument(
        "--handled-older-than",
        type=Duration(),
        default=0,
        help="delete replayed/discarded rows handled longer ago (default 0s: all)",
    )
    purge.set_defaults(handler=_purge)

    _, rabbit = common.common_parents()
    import_ = actions.add_parser(
        "import-xq",
        parents=[*parents, rabbit, output],
        help="move messages found only in RabbitMQ's .XQ queues into the dead letters",
        description=(
            "Move every message of each queue's .XQ into the dead letters (reason imported_from_xq), so replay "
            "reaches it. Idempotent by message id: a message whose death already has a row is acked off .XQ "
            "without a second row. Bodies that are not Dramatiq messages stay in .XQ (exit 8, REFUSED)."
        ),
    )
    import_.add_argument(
        "--queue",
        dest="queues",
        action="append",
        type=queue_name,
        required=True,
        metavar="NAME",
        help="a queue whose .XQ to import (repeatable)",
    )
    import_.set_defaults(handler=_import_xq)
    return parser


# --------------------------------------------------------------------------------------------
# Handlers
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _store(args: argparse.Namespace, **options: Any) -> Iterator[PostgresDeadLetterStore]:
    with open_database(args) as database:
        yield PostgresDeadLetterStore(database=database, schema=args.schema, **options)


def _filter(args: argparse.Namespace) -> DeadLetterFilter:
    return DeadLetterFilter(
        actor_name=args.actor_name,
        queue_name=args.queue_name,
        error_type=args.error_type,
        fingerprint=args.fingerprint,
        since=args.since,
        until=args.until,
    )


def _list(args: argparse.Namespace) -> int:
    where = _filter(args)
    state = None if args.state == "all" else args.state
    with _store(args) as store:
        page = store.list(where=where, state=state, limit=args.limit, cursor=args.cursor)
        # An empty first page in one state: say how many the other states hold, so an empty
        # answer after a discard does not read as "there never were any".
        others = store.count(where=where, state=None) if state and not page.items and not args.cursor else 0
    if args.json:
        output.print_json({"dead_letters": [item.as_dict() for item in page.items], "next_cursor": page.next_cursor})
        return ExitCode.OK
    if not page.items:
        print(_nothing_listed(state, where, others, after_cursor=args.cursor is not None))
        return ExitCode.OK
    now = datetime.datetime.now(datetime.timezone.utc)
    rows = [
        [
            str(item.id),
            output.ago(item.last_failed_at, now),
            item.actor_name,
            item.queue_name,
            str(item.attempts),
            item.reason,
            *([item.state] if state is None else []),
            _error_line(item),
        ]
        for item in page.items
    ]
    headers = ["ID", "AGE", "ACTOR", "QUEUE", "ATTEMPTS", "REASON", *(["STATE"] if state is None else []), "ERROR"]
    output.print_table(headers, rows, max_width=48, fit_last=True)
    if page.next_cursor:
        print(f"more: add --cursor {page.next_cursor}", file=sys.stderr)
    return ExitCode.OK


def _show(args: argparse.Namespace) -> int:
    with _store(args) as store:
        item = store.get(args.id)
    if item is None:
        print_error(f"dead letter {args.id} not found; 'dead-letters list --state all' shows the ids")
        return NOT_FOUND
    if args.json:
        output.print_json(item.as_dict())
        return ExitCode.OK
    out = sys.stdout
    out.write(f"dead letter {item.id} ({item.state})\n")
    handled = ""
    if item.handled_at is not None:
        handled = f"{item.state} at {_when(item.handled_at)} by {item.handled_by or '?'}"
        if item.replayed_to:
            handled += f" to queue {item.replayed_to!r}"
        if item.note:
            handled += f": {item.note}"
    fields = [
        ("message id", item.message_id),
        ("actor", item.actor_name),
        ("queue", item.queue_name),
        ("error", f"{item.error_type or '-'}: {item.error_message}"),
        ("reason", f"{item.reason}: {item.explanation}"),
        ("attempts", str(item.attempts)),
        ("http status", str(item.http_status) if item.http_status is not None else "-"),
        ("culprit", item.culprit or "-"),
        ("fingerprint", item.fingerprint),
        ("first sent", _when(item.sent_at)),
        ("first failed", _when(item.first_failed_at)),
        ("last failed", _when(item.last_failed_at)),
        ("worker", f"{item.worker_host} pid {item.worker_pid}"),
        ("captures", str(item.captures)),
        ("handled", handled or "-"),
    ]
    for name, value in fields:
        out.write(f"  {name:<13}{value}\n")
    message = item.message or {}
    for key in ("args", "kwargs", "options"):
        shown = message.get(key)
        if key == "options" and isinstance(shown, dict):
            # Dramatiq's Retries keeps a copy of the traceback in the options: print it once, below.
            shown = {option: setting for option, setting in shown.items() if option != "traceback"}
        out.write(f"{key}: {json.dumps(shown, sort_keys=True, default=str)}\n")
    out.write("traceback:\n")
    out.write("".join(f"  {line}\n" for line in (item.traceback or "-").rstrip("\n").splitlines()))
    return ExitCode.OK


def _stats(args: argparse.Namespace) -> int:
    where = _filter(args)
    with _store(args) as store:
        groups = store.stats(where=where, limit=args.limit)
        total = store.count(where=where)
    if args.json:
        output.print_json({"total": total, "groups": [group.as_dict() for group in groups]})
        return ExitCode.OK
    if not groups:
        print(f"no dead letters ({where.describe()})")
        return ExitCode.OK
    now = datetime.datetime.now(datetime.timezone.utc)
    rows = [
        [
            f"{group.count:,}",
            group.fingerprint,
            group.error_type or "-",
            group.culprit or "-",
            group.actor_name + (f" (+{group.actors - 1})" if group.actors > 1 else ""),
            output.ago(group.last_failed_at, now),
            _one_line(group.error_message),
        ]
        for group in groups
    ]
    output.print_table(
        ["COUNT", "FINGERPRINT", "ERROR", "CULPRIT", "ACTOR", "LAST", "MESSAGE"], rows, max_width=48, fit_last=True
    )
    shown = sum(group.count for group in groups)
    more = f"; {total - shown:,} more in smaller groups (raise --limit)" if total > shown else ""
    print(f"{total:,} dead letters in {len(groups)} group(s) shown{more}", file=sys.stderr)
    return ExitCode.OK


def _replay(args: argparse.Namespace) -> int:
    target = _target(args, "replay")
    if target is None:
        return ExitCode.USAGE
    args.to = sends_to(args, "replays")
    ids, where = target.ids or (), target.where
    with _store(args, replay_max_age_ms=args.max_age, replay_to=args.to) as store:
        if not ids:
            preview = target.preview(store, "replay", force=args.force)
            total, too_old = preview.total, preview.too_old
            if total == 0:
                return _nothing(args, "replay", where, {"replayed": 0, "too_old": 0, "problems": {}})
            question = f"replay {total:,} dead letter(s) ({where.describe()}) {_path(args.to)}"
            if too_old:
                question += (
                    f"; {too_old:,} first sent more than {output.age(args.max_age / 1000)} ago stay dead "
                    "(--force replays them)"
                )
            if not _confirm(args, question, f"replay {total:,} dead letter(s)"):
                return ExitCode.ABORTED
        progress = _Progress("replayed") if not ids else None
        result = store.replay(
            ids=ids or None,
            where=where,
            queue_name=args.to_queue,
            delay_ms=args.delay,
            force=args.force,
            progress=progress,
        )
        if progress is not None:
            progress.finish()
    if args.json:
        output.print_json(result.as_dict())
    else:
        print(f"replayed {result.replayed:,} dead letter(s) {_destination(args.to, args.to_queue, args.delay)}")
        if result.too_old and not ids:
            print(
                f"{result.too_old:,} first sent more than {output.age(args.max_age / 1000)} ago stayed dead: "
                "replay them with --force, or discard them"
            )
        for dead_letter_id, problem in sorted(result.problems.items()):
            print(f"  {dead_letter_id}: {problem}")
    return _outcome(result.problems, result.too_old)


def _discard(args: argparse.Namespace) -> int:
    target = _target(args, "discard")
    if target is None:
        return ExitCode.USAGE
    ids, where = target.ids or (), target.where
    with _store(args) as store:
        if not ids:
            total = target.preview(store, "discard").total
            if total == 0:
                return _nothing(args, "discard", where, {"discarded": 0, "problems": {}})
            question = f"discard {total:,} dead letter(s) ({where.describe()})"
            if not _confirm(args, question, f"discard {total:,} dead letter(s)"):
                return ExitCode.ABORTED
        progress = _Progress("discarded") if not ids else None
        result = store.discard(ids=ids or None, where=where, note=args.reason, progress=progress)
        if progress is not None:
            progress.finish()
    if args.json:
        output.print_json(result.as_dict())
    else:
        print(f"discarded {result.discarded:,} dead letter(s)")
        for dead_letter_id, problem in sorted(result.problems.items()):
            print(f"  {dead_letter_id}: {problem}")
    return _outcome(result.problems, 0)


def _purge(args: argparse.Namespace) -> int:
    with _store(args) as store:
        result = store.purge(
            older_than_ms=None if args.keep_dead else args.older_than,
            handled_older_than_ms=args.handled_older_than,
        )
    if args.json:
        output.print_json({"deleted": result.deleted, "dead": result.dead, "handled": result.handled})
    else:
        print(
            f"deleted {result.deleted:,} dead letter row(s): {result.handled:,} replayed or discarded, "
            f"{result.dead:,} dead past retention"
        )
    return ExitCode.OK


def _import_xq(args: argparse.Namespace) -> int:
    parameters = rabbitmq_parameters(args)
    with _store(args) as store:
        result = import_xq(store, parameters=parameters, queues=args.queues)
    if args.json:
        output.print_json(result.as_dict())
    else:
        for name in result.imported:
            line = (
                f"{name}.XQ: imported {result.imported[name]:,}, already stored {result.already_stored[name]:,} "
                "(acked off .XQ)"
            )
            if result.unreadable[name]:
                line += f", {result.unreadable[name]:,} unreadable left in .XQ"
            print(line)
    return REFUSED if any(result.unreadable.values()) else ExitCode.OK


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _path(to: str) -> str:
    """The way a replay takes, for the confirmation question."""
    return "onto the Postgres queues" if to == "queue" else "through the outbox"


def _destination(to: str, queue: str | None, delay_ms: int | None) -> str:
    """Where replays went and what moves them on: the relay for the outbox, the workers for the
    Postgres queue table (no relay is involved there)."""
    due = f", due in {output.age(delay_ms / 1000)}" if delay_ms else ""
    if to == "queue":
        where = f"Postgres queue {queue!r}" if queue else "their Postgres queues"
        return f"to {where}{due}; PostgresBroker workers take them from the queue table"
    where = f"queue {queue!r}" if queue else "their queues"
    return f"to {where} through the outbox{due}; the relay publishes them"


def _target(args: argparse.Namespace, verb: str) -> Selection | None:
    try:
        return Selection.of(args.ids, _filter(args), everything=args.all)
    except ConfigurationError:
        print_error(
            f"say which dead letters to {verb}: ids, a filter (--actor, --queue, --error-type, --fingerprint, "
            "--since, --until) or --all"
        )
        return None


def _confirm(args: argparse.Namespace, question: str, what: str) -> bool:
    if args.yes:
        return True
    if not sys.stdin.isatty():
        print_error(f"refusing to {what} without confirmation: stdin is not a terminal; pass --yes")
        return False
    print(f"{question}? [y/N] ", end="", file=sys.stderr, flush=True)
    answer = sys.stdin.readline().strip().lower()
    if answer in ("y", "yes"):
        return True
    print("aborted; nothing changed", file=sys.stderr)
    return False


def _nothing(args: argparse.Namespace, verb: str, where: DeadLetterFilter, empty: dict[str, Any]) -> int:
    if args.json:
        output.print_json(empty)
    else:
        print(f"no dead letters to {verb} ({where.describe()})")
    return ExitCode.OK


def _outcome(problems: dict[int, str] | Any, refused: int) -> int:
    if any(problem == "not found" for problem in problems.values()):
        return NOT_FOUND
    if problems or refused:
        return REFUSED
    return ExitCode.OK


class _Progress:
    """Progress of a bulk command on stderr: one line rewritten on a terminal, a line per batch otherwise."""

    def __init__(self, verb: str, stream: TextIO | None = None) -> None:
        self.verb = verb
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.shown = False

    def __call__(self, done: int, total: int) -> None:
        if done >= total and not self.shown:
            return  # one batch did it all: the summary line is enough
        percent = f" ({100 * done // total}%)" if total else ""
        text = f"{self.verb} {done:,}/{total:,}{percent}"
        if self.tty:
            self.stream.write(f"\r{text}")
        else:
            self.stream.write(f"{text}\n")
        self.stream.flush()
        self.shown = True

    def finish(self) -> None:
        if self.shown and self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _nothing_listed(state: str | None, where: DeadLetterFilter, others: int, *, after_cursor: bool) -> str:
    if after_cursor:
        return "no more dead letters: that was the last page"
    what = {"dead": "no dead letters waiting", None: "no dead letters in any state"}.get(
        state, f"no {state} dead letters"
    )
    scope = ([f"state: {state}"] if state else []) + ([] if where.is_empty else [f"filter: {where.describe()}"])
    text = f"{what} ({'; '.join(scope)})" if scope else what
    if others:
        kinds = "replayed or discarded" if state == "dead" else "in other states"
        text += f"; {others:,} {kinds}: see them with --state all"
    return text


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _error_line(item: DeadLetter) -> str:
    message = _one_line(item.error_message)
    return f"{item.error_type}: {message}" if item.error_type else message


def _when(value: datetime.datetime) -> str:
    return value.astimezone(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"
