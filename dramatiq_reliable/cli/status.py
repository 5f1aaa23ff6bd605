"""``dramatiq-reliable status``: the health numbers as a table or JSON, and ``--check`` for probes."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..health import Health, QueueDepths, Thresholds, check_health, collect_health
from . import output
from .common import Duration, ExitCode, Integer, UsageError, database_url, print_error, queue_name, rabbitmq_url

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
    )
    _add_arguments(parser)
    return parser


_COMMAND_DESCRIPTION = """\
Print the health numbers of every queue: RabbitMQ depth, delayed (.DQ) and failed (.XQ)
messages, the outbox backlog and its oldest row, dead letters and the newest, retries waiting.

With --check, exit 5 when a threshold is crossed (the reasons go to stderr), for cron,
Kubernetes probes and alerting.  Exit 3 when Postgres or RabbitMQ cannot be reached.
"""


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--queue",
        action="append",
        type=queue_name,
        default=[],
        metavar="NAME",
        help="a queue to report on (repeatable); queues found in the outbox and dead letters are added",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--skip-rabbitmq", action="store_true", help="do not connect to RabbitMQ")
    parser.add_argument("--check", action="store_true", help="exit 5 (CHECK_FAILED) when a threshold below is crossed")
    limits = parser.add_argument_group("thresholds (per queue, with --check)")
    count = Integer(minimum=0)
    limits.add_argument(
        "--max-outbox-age", type=Duration(), metavar="DURATION", help="oldest unpublished outbox row, e.g. 60s"
    )
    limits.add_argument("--max-outbox-backlog", type=count, metavar="N", help="unpublished outbox rows")
    limits.add_argument("--max-dead-letters", type=count, metavar="N", help="dead letters waiting in Postgres")
    limits.add_argument("--max-queue-depth", type=count, metavar="N", help="ready messages in RabbitMQ")
    limits.add_argument("--max-xq", type=count, metavar="N", help="messages in the queue's .XQ")
    limits.add_argument(
        "--max-xq-unstored",
        type=count,
        metavar="N",
        help="messages in the queue's .XQ with no dead-letter row (0: any; fix with 'dead-letters import-xq')",
    )
    parser.set_defaults(handler=_handle)


def _handle(args: argparse.Namespace) -> int:
    thresholds = Thresholds(
        max_outbox_age_ms=args.max_outbox_age,
        max_outbox_backlog=args.max_outbox_backlog,
        max_dead_letters=args.max_dead_letters,
        max_queue_depth=args.max_queue_depth,
        max_xq=args.max_xq,
        max_xq_unstored=args.max_xq_unstored,
    )
    if thresholds.any() and not args.check:
        raise UsageError("the --max-* thresholds apply only with --check")
    database = database_url(args)
    rabbitmq = None if args.skip_rabbitmq else QueueDepths(rabbitmq_url=rabbitmq_url(args))
    try:
        health = collect_health(
            database=database,
            schema=args.schema,
            rabbitmq=rabbitmq,
            queues=args.queue,
            discover_queues=True,
            retries_waiting=True,
            xq_unstored=args.max_xq_unstored is not None,
        )
    finally:
        if rabbitmq is not None:
            rabbitmq.close()

    problems = check_health(health, thresholds) if args.check else []
    # What cannot be reached is said first: a table of dashes means nothing without it.
    unreachable = "; ".join(problem for problem in (health.postgres_error, health.rabbitmq_error) if problem)
    if unreachable:
        print_error(unreachable)
    if args.json:
        document = health.as_dict()
        if args.check:
            document["check"] = {"ok": health.ok and not problems, "problems": problems}
        output.print_json(document)
    elif health.queues or not unreachable:
        print(render_table(health))
    if unreachable:
        return ExitCode.UNAVAILABLE
    if problems:
        for problem in problems:
            print(f"dramatiq-reliable: check failed: {problem}", file=sys.stderr)
        return ExitCode.CHECK_FAILED
    if args.check and not args.json:
        print("check passed" + ("" if thresholds.any() else " (services reachable; no thresholds given)"))
    return ExitCode.OK


_HEADERS = (
    "queue",
    "depth",
    "delayed",
    ".XQ",
    "consumers",
    "outbox",
    "oldest",
    "failing",
    "dead letters",
    "newest",
    "retrying",
)


def render_table(health: Health) -> str:
    """The reading as an aligned text table, one queue a line, with totals when there are several."""
    rows: list[tuple[str, ...]] = [
        (
            item.queue,
            _n(item.depth),
            _n(item.delayed),
            _n(item.xq),
            _n(item.consumers),
            _n(item.outbox_backlog),
            output.age(item.outbox_oldest_age_s),
            _n(item.outbox_failing),
            _n(item.dead_letters),
            _ago(item.dead_letters_newest_age_s),
            _n(item.retries_waiting),
        )
        for item in health.queues
    ]
    if len(health.queues) > 1:
        totals = health.totals()
        rows.append(
            (
                "(all)",
                _n(totals["depth"]),
                _n(totals["delayed"]),
                _n(totals["xq"]),
                "",
                _n(totals["outbox_backlog"]),
                output.age(totals["outbox_oldest_age_s"]),
                _n(totals["outbox_failing"]),
                _n(totals["dead_letters"]),
                _ago(totals["dead_letters_newest_age_s"]),
                _n(totals["retries_waiting"]),
            )
        )
    if not rows:
        return "no queues found in the outbox or the dead letters: name them with --queue"
    text = output.table(_HEADERS, rows, right=range(1, len(_HEADERS)))
    if health.dead_letters_table is False:
        text += "\n(no dead-letter table in this schema: dead letters are not counted)"
    return text


def _ago(seconds: float | None) -> str:
    return "-" if seconds is None else output.age(seconds) + " ago"


def _n(value: int | None) -> str:
    return "-" if value is None else str(value)
