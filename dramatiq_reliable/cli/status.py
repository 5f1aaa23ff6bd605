"""``dramatiq-reliable status``: the health numbers as a table or JSON, and ``--check`` for probes."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from .. import _sql
from .._util import format_age
from ..errors import ConfigurationError, SchemaNotReady
from ..health import Health, QueueDepths, Thresholds, check_health, collect_health
from .common import ExitCode, duration_ms

__all__ = ["register", "render_table"]


def register(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    parents: Sequence[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add the ``status`` command to ``dramatiq-reliable``.

    ``parents`` must supply ``--database-url``, ``--schema`` and ``--rabbitmq-url`` (the
    CLI's common parsers); the handler is set as ``handler`` and returns an exit code.
    """
    parser = subparsers.add_parser(
        "status",
        parents=list(parents),
        help="queue depth, outbox backlog, dead letters; --check for probes",
        description=_COMMAND_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(parser)
    return parser


_COMMAND_DESCRIPTION = """\
Print the health numbers of every queue: RabbitMQ depth, delayed and dead (.XQ) messages,
the outbox backlog and its oldest row, dead letters and the newest, retries waiting.

With --check, exit 5 when a threshold is crossed (the reasons go to stderr), for cron,
Kubernetes probes and alerting.  Exit 3 when Postgres or RabbitMQ cannot be reached.
"""


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--queue",
        action="append",
        default=[],
        metavar="NAME",
        help="a queue to report on (repeatable); queues found in the outbox and dead letters are added",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--skip-rabbitmq", action="store_true", help="do not connect to RabbitMQ")
    parser.add_argument("--check", action="store_true", help="exit 5 (CHECK_FAILED) when a threshold below is crossed")
    limits = parser.add_argument_group("thresholds (per queue, with --check)")
    limits.add_argument("--max-outbox-age", type=duration_ms, metavar="DURATION", help="e.g. 60s")
    limits.add_argument("--max-outbox-backlog", type=_non_negative, metavar="N")
    limits.add_argument("--max-dead-letters", type=_non_negative, metavar="N")
    limits.add_argument("--max-queue-depth", type=_non_negative, metavar="N")
    limits.add_argument("--max-dead-queue", type=_non_negative, metavar="N", help="messages in the .XQ")
    parser.set_defaults(handler=_handle, status_parser=parser)


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative; thresholds are 0 or more")
    return value


def _handle(args: argparse.Namespace) -> int:
    thresholds = Thresholds(
        max_outbox_age_ms=args.max_outbox_age,
        max_outbox_backlog=args.max_outbox_backlog,
        max_dead_letters=args.max_dead_letters,
        max_queue_depth=args.max_queue_depth,
        max_dead_queue=args.max_dead_queue,
    )
    if thresholds.any() and not args.check:
        args.status_parser.error("the --max-* thresholds apply only with --check")
    try:
        _sql.validate_schema(args.schema)
    except ConfigurationError as error:
        return _fail(str(error), ExitCode.USAGE)
    rabbitmq = None if args.skip_rabbitmq else QueueDepths(rabbitmq_url=args.rabbitmq_url)
    try:
        health = collect_health(
            database=args.database_url,
            schema=args.schema,
            rabbitmq=rabbitmq,
            queues=args.queue,
            discover_queues=True,
            retries_waiting=True,
        )
    except SchemaNotReady as error:
        return _fail(str(error), ExitCode.SCHEMA)
    finally:
        if rabbitmq is not None:
            rabbitmq.close()

    problems = check_health(health, thresholds) if args.check else []
    if args.json:
        document = health.as_dict()
        if args.check:
            document["check"] = {"ok": health.ok and not problems, "problems": problems}
        print(json.dumps(document, indent=2))
    else:
        print(render_table(health))
    if not health.ok:
        for service, problem in (("Postgres", health.postgres_error), ("RabbitMQ", health.rabbitmq_error)):
            if problem:
                print(f"dramatiq-reliable: error: cannot reach {service}: {problem}", file=sys.stderr)
        return ExitCode.UNAVAILABLE
    if problems:
        for problem in problems:
            print(f"dramatiq-reliable: check failed: {problem}", file=sys.stderr)
        return ExitCode.CHECK_FAILED
    if args.check and not args.json:
        print("check passed" + ("" if thresholds.any() else " (services reachable; no thresholds given)"))
    return ExitCode.OK


def _fail(message: str, code: ExitCode) -> int:
    print(f"dramatiq-reliable: error: {message}", file=sys.stderr)
    return int(code)


def render_table(health: Health) -> str:
    """The reading as an aligned text table, one queue a line, with totals when there are several."""
    headers = (
        "queue",
        "depth",
        "delayed",
        "dead(.XQ)",
        "consumers",
        "outbox",
        "oldest",
        "failing",
        "dead letters",
        "newest",
        "retrying",
    )
    lines: list[tuple[str, ...]] = []
    for item in health.queues:
        lines.append(
            (
                item.queue,
                _n(item.depth),
                _n(item.delayed),
                _n(item.dead),
                _n(item.consumers),
                _n(item.outbox_backlog),
                format_age(item.outbox_oldest_age_s),
                _n(item.outbox_failing),
                _n(item.dead_letters),
                format_age(item.dead_letters_newest_age_s, suffix=" ago"),
                _n(item.retries_waiting),
            )
        )
    if len(health.queues) > 1:
        totals = health.totals()
        lines.append(
            (
                "(all)",
                _n(totals["depth"]),
                _n(totals["delayed"]),
                _n(totals["dead"]),
                "",
                _n(totals["outbox_backlog"]),
                format_age(totals["outbox_oldest_age_s"]),
                _n(totals["outbox_failing"]),
                _n(totals["dead_letters"]),
                format_age(totals["dead_letters_newest_age_s"], suffix=" ago"),
                _n(totals["retries_waiting"]),
            )
        )
    if not lines:
        return "no queues found: name them with --queue"
    widths = [max(len(row[i]) for row in (headers, *lines)) for i in range(len(headers))]
    out = []
    for row in (headers, *lines):
        cells = [row[0].ljust(widths[0])] + [cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)]
        out.append("  ".join(cells).rstrip())
    if health.dead_letters_table is False:
        out.append("(no dead-letter table in this schema: dead letters are not counted)")
    return "\n".join(out)


def _n(value: int | None) -> str:
    return "-" if value is None else str(value)
