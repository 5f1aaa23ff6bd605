"""``dramatiq-reliable metrics``: the Prometheus endpoint of every queue's health numbers, served alone.

::

    dramatiq-reliable metrics [--host 127.0.0.1] [--port 9191] [--queue NAME ...] [--cache 10s]
                              [--worker-rate 1.0] [--target-wait 60s] [--min-workers N] [--max-workers N]

Needs the ``prometheus`` extra.  One process serves the fleet's numbers (read from Postgres and
RabbitMQ), so it runs beside the workers, not inside them (see :mod:`dramatiq_reliable.prometheus`).
The port is bound before anything is read: a port in use is an error at once (exit 2).
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from collections.abc import Sequence
from typing import Any

from .common import (
    Duration,
    ExitCode,
    Integer,
    UsageError,
    database_url,
    queue_name,
    rabbitmq_parameters,
)

__all__ = ["register"]

logger = logging.getLogger("dramatiq_reliable.cli.metrics")

_DESCRIPTION = """\
Serve the health numbers of every queue for Prometheus on http://HOST:PORT/metrics, until
SIGTERM or Ctrl-C: depth, delayed, .XQ, oldest age, consumers, outbox backlog and oldest row,
dead letters, retries waiting (with --retries-waiting), rate-limited keys, and the desired
workers of each queue for an autoscaler (KEDA).  Needs the prometheus extra:
pip install 'dramatiq-reliable[prometheus]'.

Run one per deployment, beside the workers: the numbers are read from Postgres and RabbitMQ,
which all workers share.  Listens on loopback unless --host says otherwise (in a container,
--host 0.0.0.0).  Queues with unpublished outbox rows, Postgres queue rows or dead letters are
reported on their own; name the others with --queue so an empty queue shows as 0."""


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < 1e9:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of jobs per second; write e.g. 2.5")
    return value


def register(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    parents: Sequence[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add ``metrics``; ``parents`` supply ``--database-url``, ``--schema`` and ``--rabbitmq-url``."""
    parser = subparsers.add_parser(
        "metrics", parents=list(parents), help="serve the health numbers for Prometheus", description=_DESCRIPTION
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=Integer(minimum=1, maximum=65535), default=9191, help="port to listen on")
    parser.add_argument(
        "--queue", action="append", type=queue_name, default=[], metavar="NAME", help="a queue to report (repeatable)"
    )
    parser.add_argument(
        "--cache",
        type=Duration(minimum_ms=0),
        default="10s",
        metavar="DURATION",
        help="how long one reading serves every scrape",
    )
    parser.add_argument(
        "--statement-timeout", type=Duration(minimum_ms=1), default="2s", metavar="DURATION", help="bound of each query"
    )
    parser.add_argument(
        "--retries-waiting",
        action="store_true",
        help="also count retries not yet due (scans the outbox's delayed rows)",
    )
    parser.add_argument(
        "--skip-rabbitmq", action="store_true", help="do not read RabbitMQ (a PostgresBroker deployment)"
    )
    parser.add_argument(
        "--worker-rate", type=_rate, default=1.0, metavar="JOBS_PER_S", help="jobs per second one worker process clears"
    )
    parser.add_argument(
        "--target-wait",
        type=Duration(minimum_ms=1000),
        default="60s",
        metavar="DURATION",
        help="how long a message may wait: desired workers clear the backlog within it",
    )
    parser.add_argument(
        "--min-workers", type=Integer(minimum=0, maximum=100_000), default=0, help="desired workers at least"
    )
    parser.add_argument(
        "--max-workers", type=Integer(minimum=1, maximum=100_000), default=None, help="desired workers at most"
    )
    parser.set_defaults(handler=_metrics, log_level=logging.INFO)
    return parser


def _metrics(args: argparse.Namespace) -> int:
    try:
        from ..prometheus import MetricsServer
    except ImportError as error:
        raise UsageError(
            f"{error}; the endpoint needs the prometheus extra: pip install 'dramatiq-reliable[prometheus]'"
        ) from None
    from ..autoscale import Autoscale
    from ..health import HealthMonitor
    from ..queue_depths import QueueDepths

    if args.max_workers is not None and args.max_workers < args.min_workers:
        raise UsageError(f"--max-workers {args.max_workers} is below --min-workers {args.min_workers}; raise it")
    autoscale = Autoscale(
        worker_rate=args.worker_rate,
        target_s=args.target_wait / 1000,
        minimum=args.min_workers,
        maximum=args.max_workers,
    )
    url = database_url(args)
    depths = None if args.skip_rabbitmq else QueueDepths(parameters=rabbitmq_parameters(args))
    queues = tuple(args.queue)
    monitor = HealthMonitor(
        database=url,
        schema=args.schema,
        rabbitmq=depths,
        queues=lambda: queues,
        ttl_ms=args.cache,
        statement_timeout_ms=args.statement_timeout,
        retries_waiting=args.retries_waiting,
    )
    stop = threading.Event()

    def stopping(signum: int, frame: Any) -> None:
        stop.set()

    # Bound before anything is read, so a port in use fails at once (ConfigurationError: exit 2).
    with MetricsServer(monitor, host=args.host, port=args.port, autoscale=autoscale) as server:
        previous = {number: signal.signal(number, stopping) for number in (signal.SIGTERM, signal.SIGINT)}
        try:
            logger.info("serving metrics for schema %r on http://%s:%d/metrics", args.schema, args.host, server.port)
            stop.wait()
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)
    logger.info("metrics endpoint stopped")
    return ExitCode.OK
