"""``dramatiq-reliable relay``: the outbox relay as a process, with a progress line in its log."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .. import events
from .._util import first_line, rabbitmq_address, redact
from ..database import Database
from ..outbox.admin import outbox_stats
from . import output
from .common import (
    Duration,
    ExitCode,
    Integer,
    database_url,
    open_database,
    rabbitmq_parameters,
    rabbitmq_url,
)

if TYPE_CHECKING:
    from ..outbox.relay import Relay

__all__ = ["ProgressLog", "register"]

logger = logging.getLogger("dramatiq_reliable.cli.relay")

_DESCRIPTION = """\
Forward committed outbox rows to RabbitMQ, marking each row only after RabbitMQ confirmed it.
Wakes itself (an idle relay probes the outbox after sleeps growing from 1 ms to
--poll-interval; producers send it nothing), wakes at once on 'outbox retry', dead-letter replays
and scheduler fires, and waits out outages of Postgres or RabbitMQ without losing a row.  Any number of relays may run at once (rows are
claimed with SKIP LOCKED).  SIGTERM or Ctrl-C finishes the batch in hand, then exits 0.

Its log (stderr, INFO) says when it starts and stops, and every --progress-interval how many
rows it published, how many wait and how many fail.  With --once it drains the backlog and
exits, printing how many rows it published.
"""


def register(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    parents: Sequence[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add ``relay``; ``parents`` supply ``--database-url``, ``--schema`` and ``--rabbitmq-url``."""
    parser = subparsers.add_parser(
        "relay", parents=list(parents), help="forward outbox rows to RabbitMQ", description=_DESCRIPTION
    )
    parser.add_argument(
        "--batch-size", type=Integer(minimum=1), default=500, metavar="N", help="rows claimed and published per pass"
    )
    parser.add_argument(
        "--poll-interval",
        type=Duration(minimum_ms=1),
        default="250ms",
        metavar="DURATION",
        help="the idle ceiling: longest sleep between probes of an idle outbox (a row after a long idle waits at most this)",
    )
    parser.add_argument(
        "--on-published",
        choices=["mark", "delete"],
        default="mark",
        help="mark: keep published rows for --retention (audits, and status counts retries); "
        "delete: remove rows once RabbitMQ confirmed them",
    )
    parser.add_argument(
        "--retention",
        type=Duration(),
        default="1d",
        metavar="DURATION",
        help="with --on-published mark: how long published rows are kept before the relay purges them",
    )
    parser.add_argument(
        "--max-priority",
        type=Integer(minimum=1, maximum=255),
        metavar="N",
        help="the workers' RabbitmqBroker max_priority, which the queues are declared with; must match (default: none)",
    )
    parser.add_argument(
        "--queue-type",
        choices=("classic", "quorum"),
        default="classic",
        help="the workers' OutboxBroker queue_type, which the queues are declared with; must match (default: classic)",
    )
    parser.add_argument(
        "--delivery-limit",
        type=Integer(minimum=1, maximum=1_000_000),
        default=20,
        metavar="N",
        help="the workers' OutboxBroker delivery_limit (quorum queues only); must match (default: 20)",
    )
    parser.add_argument("--once", action="store_true", help="drain the backlog once and exit")
    parser.add_argument(
        "--progress-interval",
        type=Duration(),
        default="60s",
        metavar="DURATION",
        help="how often the log says what the relay did; 0 for never",
    )
    # A relay's log is its output: INFO unless asked otherwise.
    parser.set_defaults(handler=_relay, log_level=logging.INFO)
    return parser


def _relay(args: argparse.Namespace) -> int:
    url = rabbitmq_url(args)
    if args.once:
        # A one-off run should fail fast and say why; the long-running relay waits outages out.
        with open_database(args) as database:
            relay = _build(args, url, database)
            try:
                published = relay.drain()
            finally:
                relay.publisher.close()
        print(f"published {output.count(published, 'row')}")
        return ExitCode.OK

    database = Database(url=database_url(args), max_size=2)
    relay = _build(args, url, database)
    progress = ProgressLog(database, schema=args.schema, interval_ms=args.progress_interval)

    def stop(signum: int, _frame: Any) -> None:
        logger.info("received %s: finishing the batch in hand", signal.Signals(signum).name)
        relay.stop()
        progress.stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    logger.info(
        "relay for schema %r: RabbitMQ at %s, batches of %d, published rows %s",
        args.schema,
        rabbitmq_address(rabbitmq_parameters(args)),
        args.batch_size,
        f"kept {output.age(args.retention / 1000)}" if args.on_published == "mark" else "deleted",
    )
    progress.start()
    try:
        relay.run()
    finally:
        progress.stop()
        database.close()
    return ExitCode.OK


def _build(args: argparse.Namespace, url: str, database: Database) -> Relay:
    from ..outbox.relay import Relay

    return Relay(
        rabbitmq_url=url,
        database=database,
        schema=args.schema,
        batch_size=args.batch_size,
        poll_interval_ms=args.poll_interval,
        on_published=args.on_published,
        retention_ms=args.retention,
        max_priority=args.max_priority,
        queue_type=args.queue_type,
        delivery_limit=args.delivery_limit,
    )


class ProgressLog:
    """Logs, every ``interval_ms``, what the relay did since the last line and what waits.

    ``relay published 1,200 rows in the last 60s; 35 rows waiting (oldest 1.2s), 0 failing``:
    enough for whoever reads the log to tell a busy relay from a stuck one without querying
    anything.  Counts come from the relay's events; the backlog from one bounded query.
    """

    def __init__(self, database: Database, *, schema: str, interval_ms: int) -> None:
        self.database = database
        self.schema = schema
        self.interval_s = interval_ms / 1000
        self._lock = threading.Lock()
        self._published = 0
        self._failed = 0
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def __call__(self, event: events.Event) -> None:
        from ..outbox.events import OutboxPublished, OutboxRowFailed

        with self._lock:
            if isinstance(event, OutboxPublished) and event.schema == self.schema:
                self._published += event.count
            elif isinstance(event, OutboxRowFailed):
                self._failed += 1

    def start(self) -> None:
        """Listen to the relay's events and log a line every interval, in a daemon thread."""
        if self.interval_s <= 0:
            return
        events.subscribe(self)
        self._thread = threading.Thread(target=self._run, name="dramatiq-reliable-relay-progress", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop logging; safe from a signal handler and more than once."""
        self._stopped.set()
        events.unsubscribe(self)

    def _run(self) -> None:
        while not self._stopped.wait(self.interval_s):
            logger.info("%s", self.line())

    def line(self) -> str:
        """The progress line for the interval just ended (and start counting the next one)."""
        with self._lock:
            published, failed, self._published, self._failed = self._published, self._failed, 0, 0
        text = f"relay published {output.count(published, 'row')} in the last {output.age(self.interval_s)}"
        if failed:
            text += f" ({output.count(failed, 'failed attempt')})"
        return f"{text}; {self._backlog()}"

    def _backlog(self) -> str:
        try:
            with self.database.connection(timeout_ms=2000) as conn:
                stats = outbox_stats(conn, schema_name=self.schema, statement_timeout_ms=2000)
        except Exception as error:  # the relay's own log says why Postgres is down
            return f"backlog unknown ({redact(first_line(error))})"
        waiting = output.count(stats.backlog, "row")
        oldest = f" (oldest {output.age(stats.oldest_age_s)})" if stats.backlog else ""
        return f"{waiting} waiting{oldest}, {stats.failing:,} failing"
