"""``dramatiq-reliable status``: the health numbers as a table or JSON, and ``--check`` for probes."""

from __future__ import annotations

import argparse
import datetime
import sys
from collections.abc import Sequence
from typing import Any

import psycopg

from ..flow import concurrency_waiting, order_waiting
from ..health import Health, SourceCounts, Thresholds, check_health, collect_health
from ..queue_depths import QueueDepths
from ..schema import ORDER_CONCURRENCY_VERSION, current_version
from . import output
from .common import (
    Duration,
    ExitCode,
    Integer,
    UsageError,
    configured_rabbitmq_url,
    database_url,
    print_error,
    queue_name,
    rabbitmq_url,
)

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
Print the health numbers of every queue: messages waiting (depth), delayed and failed (.XQ),
how long the oldest ready one has waited (Postgres queues), consumers, the outbox backlog and
its oldest row, dead letters and the newest, retries waiting.

A queue's messages wait in the Postgres queue table (PostgresBroker), in RabbitMQ (OutboxBroker),
or in both while a deployment moves from one to the other: depth, delayed and .XQ are the sum
of both places, and a cell whose queue has rows in Postgres says how the sum splits
("5 = 2 pg + 3 mq"; --json gives in_postgres and in_rabbitmq for every queue).

RabbitMQ is read when a URL is configured (--rabbitmq-url or $RABBITMQ_URL), and otherwise,
at the local default, only if this schema's outbox was ever used: a PostgresBroker deployment
has no RabbitMQ to be down.  --skip-rabbitmq never reads it.

With --check, exit 5 when a threshold is crossed (the reasons go to stderr), for cron,
Kubernetes probes and alerting.  Exit 3 when Postgres, or a RabbitMQ that is read, cannot be
reached.
"""


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--queue",
        action="append",
        type=queue_name,
        default=[],
        metavar="NAME",
        help="a queue to report on (repeatable); queues found in the outbox, the Postgres queue table and the "
        "dead letters are added",
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
    limits.add_argument(
        "--max-queue-depth", type=count, metavar="N", help="messages waiting, in Postgres and RabbitMQ together"
    )
    limits.add_argument(
        "--max-queue-age",
        type=Duration(),
        metavar="DURATION",
        help="how long the oldest ready message has waited, e.g. 5m (Postgres queues: RabbitMQ does not tell)",
    )
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
        max_queue_age_ms=args.max_queue_age,
    )
    if thresholds.any() and not args.check:
        raise UsageError("the --max-* thresholds apply only with --check")
    database = database_url(args)
    # A configured URL is always read (down is an outage); the local default only where the
    # schema shows RabbitMQ in use, so a PostgresBroker deployment is not "unavailable".
    configured = None if args.skip_rabbitmq else configured_rabbitmq_url(args)
    rabbitmq = None
    if not args.skip_rabbitmq:
        rabbitmq = QueueDepths(rabbitmq_url=configured if configured is not None else rabbitmq_url(args))
    try:
        health = collect_health(
            database=database,
            schema=args.schema,
            rabbitmq=rabbitmq,
            rabbitmq_only_if_used=configured is None,
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
    waiting = None if health.postgres_error else keys_waiting(database, args.schema)
    if args.json:
        document = health.as_dict()
        if waiting is not None:
            document["keys_waiting"] = waiting
        if args.check:
            document["check"] = {"ok": health.ok and not problems, "problems": problems}
        output.print_json(document)
    elif health.queues or not unreachable:
        print(render_table(health))
        if waiting:
            print(render_keys_waiting(waiting))
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
    "waited",
    "consumers",
    "outbox",
    "oldest",
    "failing",
    "scheduled",
    "dead letters",
    "newest",
    "retrying",
)


def render_table(health: Health) -> str:
    """The reading as an aligned text table, one queue a line, with totals when there are several.

    ``depth``, ``delayed`` and ``.XQ`` are the sums over Postgres and RabbitMQ; a cell of a queue
    with rows in Postgres, in a reading that has RabbitMQ's numbers too, shows how it splits
    (``5 = 2 pg + 3 mq``), and ``?`` marks the part of a place that could not be read.
    ``waited`` is how long the oldest ready message of a Postgres queue has waited.
    """
    split = False
    rows: list[tuple[str, ...]] = []
    for item in health.queues:
        cells = tuple(
            _count(getattr(item, field), item.in_postgres, item.in_rabbitmq, field, health.queue_sources)
            for field in ("depth", "delayed", "xq")
        )
        split = split or any(" pg" in cell for cell in cells)
        rows.append(
            (
                item.queue,
                *cells,
                output.age(item.queue_oldest_age_s),
                _n(item.consumers),
                _n(item.outbox_backlog),
                output.age(item.outbox_oldest_age_s),
                _n(item.outbox_failing),
                _n(item.outbox_scheduled),
                _n(item.dead_letters),
                _ago(item.dead_letters_newest_age_s),
                _n(item.retries_waiting),
            )
        )
    if len(health.queues) > 1:
        totals = health.totals()
        rows.append(
            (
                "(all)",
                _n(totals["depth"]),
                _n(totals["delayed"]),
                _n(totals["xq"]),
                output.age(totals["queue_oldest_age_s"]),
                "",
                _n(totals["outbox_backlog"]),
                output.age(totals["outbox_oldest_age_s"]),
                _n(totals["outbox_failing"]),
                _n(totals["outbox_scheduled"]),
                _n(totals["dead_letters"]),
                _ago(totals["dead_letters_newest_age_s"]),
                _n(totals["retries_waiting"]),
            )
        )
    if not rows:
        text = "no queues found in the outbox, the dead letters or the Postgres queue table: name them with --queue"
    else:
        text = output.table(_HEADERS, rows, right=range(1, len(_HEADERS)))
    notes = []
    if split:
        notes.append("pg: rows in the Postgres queue table (PostgresBroker); mq: messages in RabbitMQ")
    if health.rabbitmq_skipped is not None and health.postgres_error is None:
        notes.append(f"RabbitMQ not read: {health.rabbitmq_skipped}")
    if health.dead_letters_table is False:
        notes.append("no dead-letter table in this schema: dead letters are not counted")
    long_jobs = sum(item.long_jobs or 0 for item in health.queues)
    if long_jobs:
        expired = sum(item.long_jobs_expired or 0 for item in health.queues)
        notes.append(
            f"long jobs running under a lease: {long_jobs}"
            + (f", {expired} past their lease (worker gone; a relay requeues them)" if expired else "")
        )
    notes.extend(item.describe() for item in health.rate_limits)
    return "\n".join([text, *(f"({note})" for note in notes)])


def _count(
    total: int | None,
    in_postgres: SourceCounts | None,
    in_rabbitmq: SourceCounts | None,
    field: str,
    sources: frozenset[str],
) -> str:
    """A depth, delayed or .XQ cell: the sum, and its split when Postgres holds part of it."""
    if sources != {"postgres", "rabbitmq"}:
        return _n(total)
    postgres = None if in_postgres is None else getattr(in_postgres, field)
    rabbitmq = None if in_rabbitmq is None else getattr(in_rabbitmq, field)
    if total is not None:
        return f"{total} = {postgres} pg + {rabbitmq} mq" if postgres else str(total)
    # One place could not be read: its part is "?", shown only beside a part that holds some.
    if not postgres and not rabbitmq:
        return "-"
    return f"{_n(postgres, '?')} pg + {_n(rabbitmq, '?')} mq"


def _ago(seconds: float | None) -> str:
    return "-" if seconds is None else output.age(seconds) + " ago"


def _n(value: int | None, unknown: str = "-") -> str:
    return unknown if value is None else str(value)


def keys_waiting(database: str, schema: str, *, limit: int = 10) -> dict[str, list[dict[str, Any]]] | None:
    """The order keys whose jobs wait (dead heads first) and the concurrency keys with parked jobs;
    ``None`` before migration 14 or when Postgres cannot be read (the table said so already)."""
    try:
        with psycopg.connect(database, autocommit=True, connect_timeout=5) as conn:
            if (current_version(conn, schema=schema) or 0) < ORDER_CONCURRENCY_VERSION:
                return None
            order = order_waiting(conn, schema=schema, limit=limit)
            concurrency = concurrency_waiting(conn, schema=schema, limit=limit)
    except psycopg.Error:
        return None
    if not order and not concurrency:
        return {}
    now = datetime.datetime.now(datetime.timezone.utc)
    for row in order:
        row["oldest_age_s"] = round((now - row.pop("oldest_sent_at")).total_seconds(), 3)
    for row in concurrency:
        row["oldest_age_s"] = round((now - row.pop("oldest_parked_at")).total_seconds(), 3)
    return {"order": order, "concurrency": concurrency}


def render_keys_waiting(waiting: dict[str, list[dict[str, Any]]]) -> str:
    """One line per waiting key under the table: a dead head says what frees it."""
    lines = []
    for row in waiting.get("order", []):
        head = (
            f"dead head {row['head_message_id']}: replay or discard its dead letter"
            if row["head_state"] == "dead"
            else f"head {row['head_state']}"
        )
        lines.append(
            f"order key {row['key']!r}: {row['waiting']} waiting, {head} (oldest {output.age(row['oldest_age_s'])})"
        )
    for row in waiting.get("concurrency", []):
        lines.append(
            f"concurrency key {row['key']!r}: {row['running']} running, {row['parked']} parked "
            f"(oldest {output.age(row['oldest_age_s'])})"
        )
    return "\n".join(lines)
